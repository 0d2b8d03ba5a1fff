"""From a base model to a drafter and its banks with one command (docs/your-model.md).

A tiny random model with a character-level tokenizer (no chat template: a base model, so the
prompts take their completion form), saved to a folder, goes through ``entmtp-hf build-drafter``
at tiny sizes; what it writes loads with ``load_demo(model=..., heads=...)``, and greedy decoding
with it in float64 equals plain ``generate`` token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from entmtp_hf import EntMTPConfig, TopologyBank, disable_entmtp, enable_entmtp
from entmtp_hf.tools import build_drafter as bd
from entmtp_hf.tools.cli import main

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:?$\n"
TINY_ARGS = [
    "--tasks",
    "gsm8k",
    "--data-sources",
    "math",
    "--data-prompts",
    "8",
    "--data-new-tokens",
    "24",
    "--data-batch-size",
    "8",
    "--depth",
    "3",
    "--draft-vocab-size",
    "32",
    "--train-tokens",
    "6000",
    "--train-steps",
    "6",
    "--batch-tokens",
    "512",
    "--warmup-steps",
    "2",
    "--tau-prompts",
    "0",
    "--search-prompts",
    "2",
    "--timing-prompts",
    "1",
    "--search-new-tokens",
    "16",
    "--timed-sizes",
    "1,2,3",
    "--nodes",
    "8",
    "--cost-repeats",
    "2",
    "--threads",
    "1",
    "--no-progress",
]


def char_tokenizer():
    """A lower-casing character tokenizer without a chat template (pad 0, eos 1, bos 2, unk 3)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def char_llama(**config):
    """``(model, tokenizer)``: a tiny random Llama over :func:`char_tokenizer`'s vocabulary (``config``: fields
    to change), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    fields |= dict(num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), eos_token_id=None, **{**fields, **config}))
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """A tiny Llama (float32 on disk) and its tokenizer in a folder, as a user's own model would be."""
    model, tokenizer = char_llama()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # not flat: greedy runs with some structure
    folder = tmp_path_factory.mktemp("tiny-base")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def built(tiny_base, tmp_path_factory) -> dict:
    """One full run of the command, then the same command again (everything skipped)."""
    root = tmp_path_factory.mktemp("build")
    mp = pytest.MonkeyPatch()
    mp.setenv("ENTMTP_HF_CACHE", str(root / "cache"))  # the step-cost tables stay out of the user's cache
    argv = [
        "build-drafter",
        "--model",
        str(tiny_base),
        "--work-dir",
        str(root / "work"),
        "--out",
        str(root / "out"),
        *TINY_ARGS,
    ]
    try:
        first = main(argv)
        state = json.loads((root / "work" / bd.STATE_NAME).read_text())
        lines: list[str] = []
        again = bd.build_drafter(bd.options_from_args(_parse(argv)), log=lines.append)
    finally:
        mp.undo()
    return {"root": root, "argv": argv, "first": first, "state": state, "again": again, "lines": lines}


def _parse(argv: list[str]):
    from entmtp_hf.tools.cli import build_parser

    return build_parser().parse_args(argv)


def test_every_stage_runs_and_writes_its_outputs(built):
    root, state = built["root"], built["state"]
    assert built["first"] == 0 and state["complete"]
    assert [s for s in bd.STAGES if state["stages"][s]["done"]] == list(bd.STAGES)
    for s in bd.STAGES:
        entry = state["stages"][s]
        assert entry["seconds"] >= 0 and entry["summary"] and len(entry["calls"]) == 1
    assert list((root / "work" / "data").glob("distill-math.jsonl"))
    assert state["stages"]["data"]["result"]["answers"] == 8
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (root / "out" / name).is_file()
    assert (root / "out" / "banks" / "gsm8k.safetensors").is_file()
    assert (root / "work" / "search" / "gsm8k" / "report.md").is_file()
    assert json.loads((root / "out" / bd.STATE_NAME).read_text())["complete"]
    # EAGLE-3 by default, and the summary says where it serves
    assert json.loads((root / "out" / "config.json").read_text())["head_arch"] == "eagle3"
    assert state["stages"]["publish"]["result"]["serves_in"].startswith("vLLM, SGLang, TensorRT-LLM")


def test_the_bank_loads_with_a_frontier_and_this_machine(built):
    bank = TopologyBank.from_pretrained(built["root"] / "out" / "banks", task="gsm8k")
    assert len(bank) >= 2 and bank.frontier is not None
    assert bank.machines, "the calibration files this machine's entry"


def test_a_second_run_skips_every_stage(built):
    again, lines = built["again"], built["lines"]
    assert again["complete"]
    assert sum("skipped" in line for line in lines) == len(bd.STAGES)
    assert all(len(again["stages"][s]["calls"]) == 1 for s in bd.STAGES)


@pytest.mark.filterwarnings("ignore:entmtp-hf. this machine's step costs:UserWarning")
def test_greedy_decoding_with_the_built_drafter_equals_plain_generate(built, tiny_base, monkeypatch):
    """Float64, the bank as built (this model's costs unmeasured in float64: its stored choice) and
    its largest tree, on prompts the search did not use."""
    from transformers import AutoModelForCausalLM

    from entmtp_hf.tools.data.tasks import calibration_prompts

    monkeypatch.setenv("ENTMTP_HF_CACHE", str(built["root"] / "cache"))
    out = built["root"] / "out"
    largest = TopologyBank.from_pretrained(out / "banks", task="gsm8k").trees[-1]
    assert largest.num_nodes > 2
    model = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float64).eval()
    tokenizer = char_tokenizer()
    enable_entmtp(model, str(out))
    configs = [EntMTPConfig(bank=str(out / "banks"), task="gsm8k"), EntMTPConfig(tree=largest.choices)]
    try:
        for prompt in calibration_prompts("gsm8k", 5)[2:]:
            ids = torch.tensor([prompt.render(tokenizer)])
            plain = model.generate(ids, max_new_tokens=32, do_sample=False)
            for config in configs:
                tree = model.generate(ids, max_new_tokens=32, do_sample=False, entmtp_config=config)
                assert torch.equal(plain, tree), config
    finally:
        disable_entmtp(model)


def test_load_demo_takes_the_built_drafter(built, tiny_base):
    from entmtp_hf.demo import load_demo

    model, tokenizer, bank_dir = load_demo(model=str(tiny_base), heads=built["root"] / "out")
    try:
        assert bank_dir == built["root"] / "out" / "banks"
        assert TopologyBank.list_tasks(bank_dir) == ["gsm8k"]
    finally:
        disable_entmtp(model)


def test_changed_arguments_of_a_finished_stage_are_refused_until_redone(built, capsys):
    argv = [a if a != "6" else "7" for a in built["argv"]]  # --train-steps 6 -> 7
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "stage 'train'" in err and "train_steps: 6 -> 7" in err and "--redo train" in err


def test_a_budget_stops_a_stage_at_a_checkpoint_and_the_next_call_resumes(tiny_base, tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path / "cache"))
    argv = [
        "build-drafter",
        "--model",
        str(tiny_base),
        "--work-dir",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
        *TINY_ARGS,
        "--data-batch-size",
        "2",
    ]
    # 0.06 s: the data stage's share runs out while the model loads, so it stops after its first batch
    assert main([*argv, "--budget-minutes", "0.001"]) == bd.EXIT_UNFINISHED
    state = json.loads((tmp_path / "work" / bd.STATE_NAME).read_text())
    assert not state["complete"] and not state["stages"]["data"]["done"]
    assert state["stages"]["data"]["result"]["answers"] == 2
    assert main(argv) == 0
    state = json.loads((tmp_path / "work" / bd.STATE_NAME).read_text())
    assert state["complete"] and len(state["stages"]["data"]["calls"]) == 2
    assert state["stages"]["data"]["result"]["answers"] == 8


def test_answers_given_before_are_the_data_stage_and_a_foreign_record_is_refused(built, tmp_path):
    """``--data-from``: the data stage copies another run's records (checked against this model's
    vocabulary) instead of answering prompts again."""
    source = built["root"] / "work" / "data"
    copied = bd.copy_records(source, tmp_path / "data", vocab_size=len(CHARS) + 4)
    assert "distill-math.jsonl" in copied and bd._answers(tmp_path / "data") == bd._answers(source)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "distill-chat.jsonl").write_text('{"prompt_ids": [5], "response_ids": [999999]}\n')
    with pytest.raises(ValueError, match=r"distill-chat.jsonl line 1: not a record of this model"):
        bd.copy_records(foreign, tmp_path / "elsewhere", vocab_size=len(CHARS) + 4)
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(FileNotFoundError, match="no distill"):
        bd.copy_records(tmp_path / "nowhere", tmp_path / "elsewhere", vocab_size=10)


def test_a_second_drafter_reuses_the_first_runs_teacher_cache(built, tmp_path, monkeypatch):
    """``--reuse-cache WORK``: another drafter's training stage copies every row of an earlier run's
    teacher cache (its ``train/data``) instead of running the model over the sequences again."""
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(built["root"] / "cache"))
    work = built["root"] / "work"
    argv = [*built["argv"], "--work-dir", str(tmp_path / "work"), "--data-from", str(work / "data")]
    argv += ["--reuse-cache", str(work), "--arch", "mlp", "--train-steps", "2", "--tau-prompts", "0"]
    opts = bd.options_from_args(_parse(argv))
    assert opts.reuse_cache == str(work) and "reuse_cache" not in opts.stage_args()["train"]
    build = bd._Build(opts, bd.BuildState(tmp_path / "work" / bd.STATE_NAME))
    build.data(None)
    forwards = []
    model = build.loaded()[0]
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        done, result, _ = build.train(None)
    finally:
        handle.remove()
    progress = json.loads((tmp_path / "work" / "train" / "data" / "extract.json").read_text())
    assert done and result["steps"] == 2
    assert progress["copied"] and not progress["done"]  # every sequence copied, no batch extracted
    assert len(forwards) == 1  # the one sequence recomputed to check the copy comes from this model


def test_the_fused_states_are_an_argument_of_the_training_stage_and_checked_first(built):
    """``--feature-layers`` reaches the training stage's arguments (a finished stage run with other
    layers is refused); a count or arch it does not fit is refused before the data stage."""
    opts = bd.options_from_args(_parse([*built["argv"], "--arch", "eagle3", "--feature-layers", "0,1,2"]))
    assert opts.feature_layers == (0, 1, 2) and opts.stage_args()["train"]["feature_layers"] == (0, 1, 2)
    assert "feature_layers" not in bd.options_from_args(_parse(built["argv"])).stage_args()["train"]
    with pytest.raises(ValueError, match="--feature-layers: an eagle3 drafter fuses three base states"):
        bd.options_from_args(_parse([*built["argv"], "--arch", "eagle3", "--feature-layers", "1,2"]))
    with pytest.raises(ValueError, match="--feature-layers: feature_layers name the base states an 'eagle'"):
        bd.options_from_args(_parse([*built["argv"], "--arch", "mlp", "--feature-layers", "1"]))


def test_a_model_without_a_shipped_drafter_needs_heads(tmp_path):
    from entmtp_hf.demo import own_drafter

    with pytest.raises(FileNotFoundError, match="build-drafter --model my/model"):
        own_drafter("my/model", None, None)
    with pytest.raises(FileNotFoundError, match="SmolLM2"):
        own_drafter("my/model", "eagle", None)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no banks/ folder"):
        own_drafter("my/model", tmp_path, None)


def test_gemma_3_270m_gets_its_shipped_drafter_and_banks(monkeypatch):
    """The package holds Gemma 3 270M's drafter (float16, under 20 MB) and its three task banks,
    and ``load_demo(model="gemma-3-270m")`` enables them (the loader replaced: no download)."""
    import entmtp_hf.demo as demo
    from entmtp_hf import TopologyBank
    from entmtp_hf.heads import load_heads

    heads_dir, bank = demo.SHIPPED_DRAFTERS["gemma-3-270m"]
    heads = load_heads(str(heads_dir))
    assert heads.config.base_model_name_or_path == "google/gemma-3-270m" and heads.config.draft_vocab_size == 8192
    assert (heads_dir / "model.safetensors").stat().st_size < 20 * 2**20
    calls = []
    monkeypatch.setattr(demo, "load_base_model", lambda model=None, **kw: calls.append(model) or ("m", "t"))
    monkeypatch.setattr(demo, "enable_entmtp", lambda m, heads, **kw: calls.append(Path(heads)))
    _, _, bank_dir = demo.load_demo(model="gemma-3-270m")
    assert calls == ["gemma-3-270m", heads_dir] and bank_dir.name == bank
    assert sorted(TopologyBank.list_tasks(bank_dir)) == ["chat", "gsm8k", "humaneval"]


def test_load_demo_without_a_model_is_unchanged(monkeypatch):
    """The default model still gets its shipped drafter and banks (the loader replaced: no download)."""
    import entmtp_hf.demo as demo

    calls = []
    monkeypatch.setattr(demo, "load_base_model", lambda model=None, **kw: calls.append(model) or ("m", "t"))
    monkeypatch.setattr(demo, "enable_entmtp", lambda m, heads, **kw: calls.append(Path(heads).name))
    _, _, bank_dir = demo.load_demo()
    assert calls == [None, demo.DEMO_EAGLE_HEADS.name] and bank_dir == demo.demo_bank_dir("eagle")


def test_load_demo_takes_the_banks_beside_a_heads_folder_of_the_default_model(built, monkeypatch):
    import entmtp_hf.demo as demo

    monkeypatch.setattr(demo, "load_base_model", lambda model=None, **kw: ("m", "t"))
    monkeypatch.setattr(demo, "enable_entmtp", lambda m, heads, **kw: None)
    out = built["root"] / "out"
    assert demo.load_demo(heads=out)[2] == out / "banks"
    assert demo.load_demo(heads=out, banks="elsewhere")[2] == Path("elsewhere")


def test_push_to_hub_sends_the_heads_and_every_bank(built, monkeypatch):
    from entmtp_hf.heads import DraftHeads

    pushed = []
    monkeypatch.setattr(DraftHeads, "push_to_hub", lambda self, repo, **kw: pushed.append(("heads", repo)))
    monkeypatch.setattr(TopologyBank, "push_to_hub", lambda self, repo, **kw: pushed.append((self.task, repo)))
    assert bd.push_to_hub(built["root"] / "out", "me/drafter") == {"heads": "me/drafter", "banks": "me/drafter-banks"}
    assert pushed == [("heads", "me/drafter"), ("gsm8k", "me/drafter-banks")]


@pytest.mark.parametrize("family, arch", [("eagle", "eagle"), ("hydra", "prefix-mlp")])
def test_drafters_with_a_decoder_layer_fit_gemma_3(family, arch):
    """Gemma 3's text config names its classes without "Text", its rotary embedding takes a layer
    type and its MLP a hidden_activation: the drafter a base Gemma 3 gets, lossless."""
    from tiny import VOCAB, fitted_heads, tiny_model

    from entmtp_hf import MC_SIM_7B_63

    model = tiny_model("gemma3", seed=1)
    enable_entmtp(model, fitted_heads(model, family, arch, steps=20))
    try:
        ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
        plain = model.generate(ids, max_new_tokens=40, do_sample=False)
        tree = model.generate(ids, max_new_tokens=40, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert torch.equal(plain, tree)
    finally:
        disable_entmtp(model)


@pytest.mark.parametrize("compile", [False, True])
def test_load_demo_calibrates_the_path_its_model_decodes_on(monkeypatch, compile):
    """Compiled by default: the step costs are measured once compiled decoding is the model's default
    (a table is keyed by the compiled route), not on the eager model before it."""
    import entmtp_hf.demo as demo

    calls = []
    monkeypatch.setattr(demo, "load_base_model", lambda model=None, **kw: ("m", "t"))
    monkeypatch.setattr(demo, "enable_entmtp", lambda m, heads, calibrate: calls.append(("enable", calibrate)))
    monkeypatch.setattr(demo, "use_compiled_decoding", lambda m: calls.append(("compile",)))
    monkeypatch.setattr(demo, "calibrate_costs", lambda m, batch_sizes: calls.append(("calibrate", batch_sizes)))
    demo.load_demo(calibrate=[1, 4], compile=compile)
    if compile:
        assert calls == [("enable", False), ("compile",), ("calibrate", [1, 4])]
    else:
        assert calls == [("enable", [1, 4])]
