"""MTP layers trained for a model without them and saved in transformers' native layout.

A tiny random Llama saved to a folder gets two MTP layers
trained by the common loop on its own greedy continuations; the folder they are written to loads
with ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``, transformers' own
``generate(use_mtp=True)`` on it equals plain greedy decoding, and EntMTP drafts exactly what
``use_mtp=True`` drafts with a chain as long as its layers, and losslessly with trees. Float64.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_mtp import _assert_parity, _plain, mtp_model, prompt  # noqa: F401 (the fixture)
from test_training import config as train_config
from test_your_model import TINY_ARGS, tiny_base  # noqa: F401 (the fixture)
from tiny import VOCAB
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from entmtp_hf import TopologyBank
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.errors import FileFormatError
from entmtp_hf.heads import HeadsMismatchError, MtpHeads
from entmtp_hf.integration import disable_entmtp, enable_entmtp
from entmtp_hf.tools import build_drafter as bd
from entmtp_hf.tools.cli import main
from entmtp_hf.tools.training import (
    SPLIT_TRAIN,
    SPLIT_VAL,
    TeacherCache,
    TokenSeq,
    TrainConfig,
    extract_hidden,
    train_heads,
)
from entmtp_hf.tools.training import mtp_layout as layout
from entmtp_hf.trees.tree import MC_SIM_7B_63

H, LAYERS = 32, 2


def _base(folder, tied: bool = False):
    """A tiny Llama with sharp greedy runs, saved to ``folder`` and loaded from it (as a user's model). Tied
    embeddings (the demo model's) make a random one repeat its last token: untied unless asked."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.save_pretrained(folder)
    return _plain(AutoModelForCausalLM.from_pretrained(folder))


def _cache(root, model, n: int = 24) -> TeacherCache:
    """The model's own greedy continuations of random prompts (every fourth held out)."""
    g = torch.Generator().manual_seed(1)
    seqs = []
    for k in range(n):
        ids = torch.randint(0, VOCAB, (1, 4 + k % 5), generator=g)
        out = model.generate(ids, max_new_tokens=24, do_sample=False)[0]
        seqs.append(
            TokenSeq("distill", tuple(out.tolist()), ids.shape[1] - 1, SPLIT_VAL if k % 4 == 3 else SPLIT_TRAIN)
        )
    cache = TeacherCache.create(root, seqs, H, {"sources": {}})
    extract_hidden(model, cache, batch_tokens=128, log=lambda m: None)
    return cache


def _config(tmp_path, **kw) -> TrainConfig:
    """test_training's small run, as MTP layers: longer, on longer texts."""
    args = dict(family="mtp", arch="mtp", num_layers=LAYERS, num_heads=4, draft_vocab_size=16, batch_tokens=128)
    return train_config(tmp_path, **{**args, "max_seq_len": 64, "epochs": 30, "lr": 1e-2, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-train")
    model = _base(root / "base")
    cache = _cache(root / "data", model)
    cfg = _config(root)
    summary = train_heads(cfg, model, cache=cache, measure=False)
    return {"root": root, "cfg": cfg, "summary": summary, "out": root / cfg.run_name / "final", "cache": cache}


def _native(trained, trust: bool = True):
    model = AutoModelForCausalLM.from_pretrained(trained["out"], dtype=torch.float64, trust_remote_code=trust)
    return _plain(model)


# ----------------------------------------------------------------------------- training and layout
def test_the_mtp_arch_trains_mtp_layers_over_the_whole_vocabulary(trained):
    summary, cfg = trained["summary"], trained["cfg"]
    assert cfg.family == "mtp" and TrainConfig(arch="mtp").family == "mtp"
    curve = summary["loss_curve"]
    assert np.mean(curve[-5:]) < 0.6 * np.mean(curve[:5])
    assert len(summary["validation"]["top1"]) == 4  # every drafted depth, the last two by the last layer again
    assert summary["validation"]["top1"][0] > 0.5
    assert summary["draft_vocab_size"] == 16  # saved beside the layers for EntMTP, not trained on
    readme = (trained["out"] / "README.md").read_text()
    assert "library_name: transformers" in readme and "use_mtp=True" in readme and "| 4 | 2 | t+5 |" in readme


def test_the_folder_is_the_base_model_plus_its_mtp_layers(trained):
    out, base = trained["out"], trained["root"] / "base"
    config = json.loads((out / "config.json").read_text())
    assert config["num_mtp_layers"] == LAYERS
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_mtp.LlamaMtpForCausalLM"}
    assert config["architectures"] == ["LlamaMtpForCausalLM"]
    assert filecmp.cmp(out / layout.BASE_SHARD, base / "model.safetensors", shallow=False)  # byte for byte
    index = json.loads((out / layout.INDEX_NAME).read_text())["weight_map"]
    mtp = {k for k, f in index.items() if f == layout.MTP_SHARD}
    assert mtp and all(k.startswith("mtp.layers.") for k in mtp) and "mtp.layers.1.eh_proj.weight" in mtp
    # the layers trained are the layers saved (the newest checkpoint holds the trained weights)
    ckpt = sorted((trained["root"] / trained["cfg"].run_name / "checkpoints").glob("step-*"))[-1]
    trained_weights = load_file(ckpt / "heads.safetensors")
    saved = load_file(out / layout.MTP_SHARD)
    assert saved.keys() == {f"mtp.{k}" for k in trained_weights if k.startswith("layers.")}
    assert all(torch.equal(saved[f"mtp.{k}"], v) for k, v in trained_weights.items() if k.startswith("layers."))
    assert layout.drafting_settings(out)["depth"] == 4 and len(layout.drafting_settings(out)["draft_vocab"]) == 16


def test_transformers_use_mtp_runs_the_saved_layers_losslessly(trained):
    model = _native(trained)
    assert type(model).__name__ == "LlamaMtpForCausalLM"
    for seed, length in enumerate((4, 7)):
        ids = prompt(length, seed)
        plain = model.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False, use_mtp=True), plain)


def test_entmtp_drafts_what_use_mtp_drafts_and_is_lossless_with_trees(trained, monkeypatch):
    model = enable_entmtp(_native(trained), "mtp", cpu_kernels=False)
    try:
        heads = model.entmtp_heads
        saved = load_file(trained["out"] / layout.MTP_SHARD)
        assert all(
            torch.equal(p.to(saved[f"mtp.layers.{k}"].dtype), saved[f"mtp.layers.{k}"])
            for k, p in heads.layers.state_dict().items()
        )
        accepted = _assert_parity(model, LAYERS, monkeypatch, lengths=(4, 6, 9))
        assert accepted - {0}, "the trained layers' drafts should be accepted at times"
        ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
        mask[1, :3], mask[2, :6] = 0, 0
        for batch, attention in ((ids[:1], None), (ids, mask)):
            ref = model.generate(batch, attention_mask=attention, max_new_tokens=20, do_sample=False, pad_token_id=0)
            out = model.generate(
                batch,
                attention_mask=attention,
                max_new_tokens=20,
                do_sample=False,
                pad_token_id=0,
                entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
            )
            assert torch.equal(out, ref)
    finally:
        disable_entmtp(model)


def test_entmtp_drafts_with_the_folders_drafting_settings(trained):
    model = _native(trained)
    drafter = layout.mtp_drafter(model, trained["out"])
    assert (
        drafter.num_heads == 4
        and drafter.draft_vocab.tolist() == layout.drafting_settings(trained["out"])["draft_vocab"]
    )
    assert layout.mtp_drafter(model, trained["out"], draft_vocab=None).draft_vocab is None
    enable_entmtp(model, drafter, cpu_kernels=False)
    try:
        ids = prompt(6, 3)
        ref = model.generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(
            model.generate(ids, max_new_tokens=20, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63)), ref
        )
    finally:
        disable_entmtp(model)


def test_without_trust_remote_code_the_refusal_says_to_trust_it(trained):
    model = _native(trained, trust=False)
    assert type(model) is LlamaForCausalLM
    with pytest.raises(HeadsMismatchError, match="trust_remote_code=True"):
        MtpHeads.from_model(model)


def test_a_run_stopped_at_a_checkpoint_resumes_to_the_same_layers(trained, tmp_path):
    model = _plain(AutoModelForCausalLM.from_pretrained(trained["root"] / "base"))
    kw = dict(epochs=2)
    full = train_heads(_config(tmp_path, run_name="full", **kw), model, cache=trained["cache"], measure=False)
    part = _config(tmp_path, run_name="part", **kw)
    train_heads(part, model, cache=trained["cache"], measure=False, stop_after=3)
    rest = train_heads(part, model, cache=trained["cache"], measure=False, resume=True)
    assert rest["steps"] == full["steps"] and full["loss_curve"][-len(rest["loss_curve"]) :] == rest["loss_curve"]
    a, b = (load_file(tmp_path / r / "final" / layout.MTP_SHARD) for r in ("full", "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not hasattr(model.config, "num_mtp_layers")  # the base model's config is left as it was


# ----------------------------------------------------------------------------- refusals
def test_a_run_continues_the_layers_of_an_earlier_runs_folder(trained, tmp_path):
    """``--init-from`` an MTP model folder: the run starts from its layers and keeps its drafting vocabulary
    (at lr 0 the layers come out as they went in), or chooses the vocabulary anew from the data."""
    model = _plain(AutoModelForCausalLM.from_pretrained(trained["root"] / "base"))
    given = load_file(trained["out"] / layout.MTP_SHARD)
    vocab = layout.drafting_settings(trained["out"])["draft_vocab"]
    cfg = _config(tmp_path, run_name="again", init_from=str(trained["out"]), lr=0.0, epochs=1)
    summary = train_heads(cfg, model, cache=trained["cache"], measure=False)
    out = tmp_path / "again" / "final"
    again = load_file(out / layout.MTP_SHARD)
    assert again.keys() == given.keys() and all(torch.equal(again[k], given[k]) for k in given)
    assert layout.drafting_settings(out)["draft_vocab"] == vocab and len(vocab) == 16
    assert summary["validation"]["top1"] == trained["summary"]["validation"]["top1"]
    assert f"Training continued the layers in `{trained['out']}`" in (out / "README.md").read_text()

    cfg = _config(tmp_path, run_name="vocab", init_from=str(trained["out"]), init_vocab="data", draft_vocab_size=8)
    train_heads(cfg, model, cache=trained["cache"], measure=False, stop_after=1)
    assert len(layout.drafting_settings(tmp_path / "vocab" / "final")["draft_vocab"]) == 8
    cfg = _config(tmp_path, run_name="other", init_from=str(trained["out"]), draft_vocab_size=8)
    with pytest.raises(ValueError, match="its drafting vocabulary has 16 rows .* asks for 8 .* --init-vocab data"):
        train_heads(cfg, model, cache=trained["cache"], measure=False)


def test_init_from_refuses_what_is_not_the_same_layers(trained, tmp_path):
    model = _plain(AutoModelForCausalLM.from_pretrained(trained["root"] / "base"))
    heads = layout.new_mtp_heads(model, 1, 2)  # the folder holds two layers
    with pytest.raises(FileFormatError, match=rf"{layout.MTP_SHARD}: its MTP tensors are not those of 1 layer"):
        layout.load_trained_layers(heads, trained["out"])
    with pytest.raises(layout.MtpLayoutError, match="--init-from .*no MTP layers here"):
        layout.load_trained_layers(heads, trained["root"] / "base")


def test_refusals_name_what_is_wrong(trained, tmp_path):
    with pytest.raises(ValueError, match="need num_layers >= 1"):
        TrainConfig(arch="mtp", num_layers=0, tau_prompts=0)
    native = _native(trained)
    with pytest.raises(layout.MtpLayoutError, match="carries MTP layers already"):
        layout.new_mtp_heads(native, 1, 4)
    with pytest.raises(layout.MtpLayoutError, match="has MTP layers already"):
        layout.write_mtp_checkpoint(trained["out"], load_file(trained["out"] / layout.MTP_SHARD), tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(layout.MtpLayoutError, match="not an MTP checkpoint"):
        layout.write_mtp_checkpoint(trained["root"] / "base", trained["out"] / layout.MTP_SHARD, tmp_path / "busy")
    with pytest.raises(layout.MtpLayoutError, match="keyed under 'mtp.'"):
        layout.write_mtp_checkpoint(trained["root"] / "base", {"layers.0.x": torch.zeros(1)}, tmp_path / "y")
    with pytest.raises(layout.MtpLayoutError, match="no MTP layers in the native layout"):
        layout.load_mtp_checkpoint(trained["root"] / "base")


def test_a_model_with_tied_embeddings_saves_and_loads_its_layers(tmp_path):
    """The demo model ties its LM head to its embeddings: its checkpoint has no LM head, the MTP layers share it."""
    model = _base(tmp_path / "base", tied=True)
    heads = layout.new_mtp_heads(model, 1, 3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = layout.write_mtp_checkpoint(tmp_path / "base", layout.mtp_tensors(heads), tmp_path / "mtp")
    native, _ = layout.load_mtp_checkpoint(out, dtype=torch.float64)
    loaded = MtpHeads.from_model(_plain(native))
    assert all(torch.equal(v, loaded.layers.state_dict()[k].float()) for k, v in heads.layers.state_dict().items())
    ids = prompt(5, 0)
    plain = native.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(native.generate(ids, max_new_tokens=12, do_sample=False, use_mtp=True), plain)


# ----------------------------------------------------------------------------- build-drafter --arch mtp
@pytest.fixture(scope="module")
def built_mtp(tiny_base, tmp_path_factory) -> dict:  # noqa: F811 (the imported fixture)
    """``entmtp-hf build-drafter --arch mtp`` on the tiny base model of the build-drafter tests."""
    root = tmp_path_factory.mktemp("build-mtp")
    mp = pytest.MonkeyPatch()
    mp.setenv("ENTMTP_HF_CACHE", str(root / "cache"))
    argv = ["build-drafter", "--model", str(tiny_base), "--work-dir", str(root / "work"), "--out", str(root / "out")]
    try:
        code = main([*argv, *TINY_ARGS, "--arch", "mtp", "--mtp-layers", "2", "--train-steps", "30"])
    finally:
        mp.undo()
    return {"root": root, "code": code, "state": json.loads((root / "work" / bd.STATE_NAME).read_text())}


def test_build_drafter_writes_mtp_layers_in_the_native_layout_with_their_banks(built_mtp):
    root, state = built_mtp["root"], built_mtp["state"]
    assert built_mtp["code"] == 0 and state["complete"]
    assert state["stages"]["train"]["args"]["mtp_layers"] == 2
    out = root / "out"
    assert layout.is_mtp_checkpoint(out) and (out / "banks" / "gsm8k.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["num_mtp_layers"] == 2
    assert "use_mtp=True" in state["stages"]["publish"]["result"]["serves_in"]
    assert "MTP layer" in state["stages"]["train"]["summary"]


@pytest.mark.filterwarnings("ignore:entmtp-hf. this machine's step costs:UserWarning")
def test_the_built_folder_decodes_losslessly_with_use_mtp_and_with_its_banks(built_mtp, monkeypatch):
    from entmtp_hf.tools.data.tasks import calibration_prompts

    monkeypatch.setenv("ENTMTP_HF_CACHE", str(built_mtp["root"] / "cache"))
    out = built_mtp["root"] / "out"
    model, tokenizer = layout.load_mtp_checkpoint(out, dtype=torch.float64)
    enable_entmtp(model, layout.mtp_drafter(model, out))
    largest = TopologyBank.from_pretrained(out / "banks", task="gsm8k").trees[-1]
    configs = [EntMTPConfig(bank=str(out / "banks"), task="gsm8k"), EntMTPConfig(tree=largest.choices)]
    try:
        for p in calibration_prompts("gsm8k", 4)[2:]:
            ids = torch.tensor([p.render(tokenizer)])
            plain = model.generate(ids, max_new_tokens=24, do_sample=False)
            assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False, use_mtp=True), plain)
            for config in configs:
                assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False, entmtp_config=config), plain)
    finally:
        disable_entmtp(model)


def test_load_demo_takes_a_built_mtp_folder(built_mtp, tmp_path):
    from entmtp_hf.demo import load_demo

    out = built_mtp["root"] / "out"
    model, tokenizer, bank_dir = load_demo(model=str(out), heads="mtp")
    try:
        assert bank_dir == out / "banks" and isinstance(model.entmtp_heads, MtpHeads) and tokenizer is not None
        assert model.entmtp_heads.draft_vocab.numel() == 32  # the folder's drafting settings
    finally:
        disable_entmtp(model)
    with pytest.raises(FileNotFoundError, match="no folder of MTP layers"):
        load_demo(model=str(tmp_path), heads="mtp")


@pytest.mark.filterwarnings("ignore:entmtp-hf. this machine's step costs:UserWarning")
def test_calibrate_and_search_take_the_folders_mtp_layers(built_mtp, tmp_path, monkeypatch, capsys):
    """``--heads mtp`` (with ``--trust-remote-code``) in the tools: the built folder's layers, drafting as its
    banks were searched; calibrate ranks the folder's banks on them."""
    from entmtp_hf.tools.models import heads_source, load_base_model
    from entmtp_hf.tools.search.cli import _load_heads

    monkeypatch.setenv("ENTMTP_HF_CACHE", str(built_mtp["root"] / "cache"))
    out = built_mtp["root"] / "out"
    model, _ = load_base_model(str(out), trust_remote_code=True)
    drafter = heads_source("mtp", model, str(out))
    assert isinstance(drafter, MtpHeads) and drafter.draft_vocab.numel() == 32
    assert heads_source("mtp", model, None).draft_vocab is None  # no folder: the whole vocabulary, as use_mtp
    assert heads_source("some/heads", model, str(out)) == "some/heads"
    args = argparse.Namespace(random_heads=0, heads="mtp", model=str(out))
    heads, name = _load_heads(args, model)
    assert isinstance(heads, MtpHeads) and heads.draft_vocab.numel() == 32 and str(out) in name

    argv = ["calibrate", str(out / "banks"), "--model", str(out), "--heads", "mtp", "--trust-remote-code"]
    assert main([*argv, "--tasks", "gsm8k", "--out", str(tmp_path / "cal"), "--threads", "1"]) == 0
    assert TopologyBank.from_pretrained(tmp_path / "cal", task="gsm8k").trees
    capsys.readouterr()
    assert main([*argv[:-1], "--tasks", "gsm8k", "--out", str(tmp_path / "cal2")]) != 0
    assert "--trust-remote-code" in capsys.readouterr().err


def test_a_malformed_drafting_settings_file_is_named(tmp_path):
    (tmp_path / layout.DRAFTING_FILE).write_text('{"depth": "deep"}')
    with pytest.raises(FileFormatError, match=layout.DRAFTING_FILE):
        layout.drafting_settings(tmp_path)
    (tmp_path / layout.DRAFTING_FILE).write_text("{not json")
    with pytest.raises(FileFormatError, match=layout.DRAFTING_FILE):
        layout.drafting_settings(tmp_path)


def test_push_to_hub_sends_the_model_folder_and_the_banks(built_mtp, monkeypatch):
    from huggingface_hub import HfApi

    pushed = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo, **kw: pushed.append(("create", repo)))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: pushed.append(("upload", kw["repo_id"])))
    monkeypatch.setattr(TopologyBank, "push_to_hub", lambda self, repo, **kw: pushed.append((self.task, repo)))
    bd.push_to_hub(built_mtp["root"] / "out", "me/mtp")
    assert pushed == [("create", "me/mtp"), ("upload", "me/mtp"), ("gsm8k", "me/mtp-banks")]


# ----------------------------------------------------------------------------- load_demo(heads="mtp")
def test_the_demo_mtp_layers_are_joined_to_the_demo_model_once(trained, tmp_path, monkeypatch):
    """The shipped layers (a stand-in here) and the demo model's copy (the tiny base) make the native folder in
    the cache, written again only when the shipped layers change."""
    import entmtp_hf.demo as demo
    from entmtp_hf.tools import models

    if not (demo.DEMO_MTP / layout.MTP_SHARD).is_file():
        with pytest.raises(FileNotFoundError, match="build-drafter --model smollm2-135m-instruct --arch mtp"):
            demo.load_demo(heads="mtp")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name in (layout.MTP_SHARD, layout.DRAFTING_FILE, "README.md"):
        shutil.copyfile(trained["out"] / name, shipped / name)
    base = tmp_path / "cache" / "Tiny"
    shutil.copytree(trained["root"] / "base", base)
    monkeypatch.setattr(demo, "DEMO_MTP", shipped)
    monkeypatch.setattr(models, "demo_model_dir", lambda cache_dir=None, name=None: base)
    model, _, bank_dir = demo.load_demo(heads="mtp", banks=tmp_path / "banks")
    folder = tmp_path / "cache" / "Tiny-mtp"
    assert bank_dir == tmp_path / "banks" and layout.is_mtp_checkpoint(folder)
    assert type(model).__name__ == "LlamaMtpForCausalLM" and model.entmtp_heads.draft_vocab.numel() == 16
    disable_entmtp(model)
    stamp = (folder / layout.MTP_SHARD).stat().st_mtime_ns
    assert demo.demo_mtp_dir() == folder and (folder / layout.MTP_SHARD).stat().st_mtime_ns == stamp
    settings = layout.drafting_settings(shipped)
    (shipped / layout.DRAFTING_FILE).write_text(json.dumps({**settings, "draft_vocab": None}))
    demo.demo_mtp_dir()
    assert layout.drafting_settings(folder)["draft_vocab"] is None


def _teacher_forcing_matches_drafting(model, heads, lengths) -> None:
    """``forward_train`` on the text a chain drafted gives the chain's own distributions at every depth."""
    from entmtp_hf.trees.tree import Tree

    depth = heads.num_heads
    chain = Tree.chain(depth).buffers("cpu", torch.float64)
    for seed, length in enumerate(lengths):
        ids, root = prompt(length, seed), torch.tensor(seed + 1)
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=-1).hidden_states[-1][0]
        state = heads.new_state(model)
        heads.observe(state, hidden, tokens=ids[0])
        drafted = heads.propose(state, root, chain)
        text = torch.cat([ids[0], drafted.tokens])[None]  # the prompt, the root, the drafted chain
        with torch.no_grad():
            full = model(text, output_hidden_states=-1).hidden_states[-1]
            logits = heads.forward_train(full, text, model.get_input_embeddings(), model.get_output_embeddings())
        assert len(logits) == depth
        for k, element in enumerate(logits):
            probs = torch.softmax(element[0, length - 1], -1)
            assert int(probs.argmax()) == int(drafted.tokens[k + 1]), (length, k)
            assert torch.allclose(probs.max(), drafted.probs[k + 1], rtol=0, atol=1e-10), (length, k)


def test_teacher_forcing_scores_every_depth_as_the_tree_drafts_it(trained):
    """What training and the tree search read: the two depths below the layer count and the two the last layer
    drafts again."""
    model = _native(trained)
    heads = MtpHeads.from_model(model, 4)
    assert heads.num_heads == 4 and heads.config.num_layers == LAYERS
    _teacher_forcing_matches_drafting(model, heads, (3, 6, 11))


@pytest.mark.parametrize("family", ["mellum", "ernie4_5_moe"])
def test_teacher_forcing_of_one_layer_drafting_deeper_matches_drafting(mtp_model, family):  # noqa: F811
    """One MTP layer drafting five deep; Mellum's a sliding window of 3, shorter than the texts."""
    model = mtp_model(family, enable=False)
    _teacher_forcing_matches_drafting(model, MtpHeads.from_model(model, 5), (2, 5, 9))
