"""``scripts/bench_mtp.py`` on a tiny model with MTP layers in transformers' native layout and a bank beside them:
the script a benchmark machine runs on the demo model's layers, end to end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from test_your_model import char_llama
from transformers import AutoModelForCausalLM

from entmtp_hf import TopologyBank, enable_entmtp
from entmtp_hf.tools.training import mtp_layout as layout
from entmtp_hf.trees.tree import Tree

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_mtp.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_mtp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copying_base(folder: Path) -> None:
    """A tiny Llama with tied embeddings and its character tokenizer in ``folder``: scaled up, its embeddings
    outweigh its random layers, so that it repeats its last token and drafts of that token are accepted."""
    model, tokenizer = char_llama(max_position_embeddings=2048, tie_word_embeddings=True)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory) -> Path:
    """The base model plus one MTP layer that drafts the token it is given (its projection passes the token's
    embedding, its decoder block adds nothing), drafting three deep, laid out as ``build-drafter --arch mtp``
    writes it, with a two-tree bank in its ``banks/``."""
    root = tmp_path_factory.mktemp("bench-mtp")
    _copying_base(root / "base")
    heads = layout.new_mtp_heads(AutoModelForCausalLM.from_pretrained(root / "base"), 1, 3)
    with torch.no_grad():
        for name, p in heads.layers.named_parameters():
            if name.endswith("eh_proj.weight"):  # [embedding, hidden] -> the embedding
                p.copy_(torch.cat([torch.eye(p.shape[0]), torch.zeros(p.shape[0], p.shape[0])], dim=1))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    out = root / "model"
    layout.write_mtp_checkpoint(
        root / "base", layout.mtp_tensors(heads), out, drafting={"depth": 3, "draft_vocab": None}
    )
    TopologyBank("default", [Tree.chain(1), Tree.chain(3)]).save_pretrained(out / "banks")
    return out


@pytest.mark.filterwarnings("ignore:entmtp-hf. this machine's step costs:UserWarning")
def test_the_script_reports_every_prompt_and_equals_plain_greedy(mtp_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path / "cache"))
    argv = ["--model", str(mtp_folder), "--tasks", "gsm8k", "chat", "--n", "2", "--max-new-tokens", "8"]
    argv += ["--batch-sizes", "1", "2", "--threads", "1", "--no-progress", "--out", str(tmp_path / "out")]
    assert _script().main(argv) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["use_mtp_load_ms"] > 0  # what use_mtp=True pays in each call, reported beside its times

    single = results["single"]
    assert [(r["task"], len(r["methods"])) for r in single] == [("gsm8k", 3)] * 2 + [("chat", 3)] * 2
    for r in single:
        m = r["methods"]
        assert all(m[k]["identical"] and m[k]["mismatch"] is None for k in m), r["prompt_id"]
        assert all(m[k]["new_tokens"] == 8 and m[k]["time_s"] > 0 for k in m)
        assert m["plain"]["forwards"] == 8 and m["plain"]["tokens_per_step"] == 1.0  # the hook counts each forward
        # every draft is accepted: after the prefill's token, one MTP layer adds two tokens a step (7 in 4 steps),
        # EntMTP's chain of three four (7 in 2)
        assert m["use_mtp"]["tokens_per_step"] == 7 / 4 and m["entmtp"]["tokens_per_step"] == 7 / 2
        assert m["entmtp"]["forwards_match_steps"] and m["entmtp"]["tokens_per_step_stats"] == 7 / 2
        assert r["speedup_vs_use_mtp"] == pytest.approx(m["use_mtp"]["time_s"] / m["entmtp"]["time_s"])

    batched = results["batched"]
    assert [(r["task"], r["batch_size"]) for r in batched] == [("gsm8k", 2), ("chat", 2)]
    assert all(r["rows_identical"] == 2 and not r["mismatches"] and r["speedup_vs_plain"] > 0 for r in batched)

    summary = results["summary"]
    assert set(summary["single"]) == {"gsm8k", "chat"} and summary["batched"]["chat"]["2"]["rows_identical"] == 2
    assert all(v["differing_prompts"] == {"use_mtp": 0, "entmtp": 0} for v in summary["single"].values())
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "| gsm8k | 2 |" in table and "use_mtp=True` is not run here" in table and table in capsys.readouterr().out
    assert all(f"| {r['task']} | {r['prompt_id']} | 8 |" in table for r in single)  # every prompt's own row


@pytest.mark.filterwarnings("ignore:entmtp-hf. this machine's step costs:UserWarning")
def test_without_cpu_kernels_entmtp_runs_on_f_linear_and_the_summary_says_so(mtp_folder, tmp_path, monkeypatch):
    from entmtp_hf.cpu_kernels import kernels_of

    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path / "cache"))
    script = _script()
    argv = ["--model", str(mtp_folder), "--tasks", "gsm8k", "--n", "1", "--max-new-tokens", "4", "--batch-sizes", "1"]
    argv += ["--threads", "1", "--no-progress", "--out", str(tmp_path / "out")]
    args = script.parse_args(argv + ["--no-cpu-kernels"])
    assert not args.cpu_kernels and script.parse_args(argv).cpu_kernels
    assert kernels_of(script.Bench(script.parse_args(argv)).model) is not None  # enable_entmtp's default
    assert kernels_of(script.Bench(args).model) is None
    assert script.main(argv + ["--no-cpu-kernels"]) == 0
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "EntMTP on `F.linear` too (`--no-cpu-kernels`)" in table


def test_a_difference_from_plain_greedy_is_reported_with_its_position():
    """A run whose output leaves plain greedy's is flagged with the first position that differs, in its record
    and in the task's summary, and is not averaged away."""
    script = _script()
    bench = script.Bench.__new__(script.Bench)
    bench.model = None  # no logit gap without the model: the position alone

    def run(rows, seconds, forwards, stats=None):
        return [{"rows": [rows], "time_s": seconds, "forwards": forwards, "stats": stats or {}}]

    stats = {"steps": 2, "mean_accept_length": 1.5, "tree_sizes": [4, 4]}
    runs = {
        "plain": run([5, 6, 7, 8], 0.4, 4),
        "use_mtp": run([5, 6, 7, 8], 0.3, 3),
        "entmtp": run([5, 6, 9, 9], 0.2, 3, stats),
    }
    record = bench.single_record("gsm8k", "p0", [1, 2, 3], runs)
    entmtp = record["methods"]["entmtp"]
    assert not entmtp["identical"] and entmtp["mismatch"]["position"] == 2 and entmtp["mismatch"]["token"] == 9
    assert record["methods"]["use_mtp"]["identical"] and entmtp["forwards_match_steps"]
    assert record["speedup_vs_use_mtp"] == pytest.approx(1.5) and record["speedup_vs_plain"] == pytest.approx(2.0)
    summary = script.summarize([record], [])["single"]["gsm8k"]
    assert summary["differing_prompts"] == {"use_mtp": 0, "entmtp": 1} and summary["bar_met"]
    assert summary["tokens_per_step"] == {"plain": 1.0, "use_mtp": 1.5, "entmtp": 1.5}
    table = script.table(
        {
            "settings": {"n": 1, "max_new_tokens": 4, "repeats": 1},
            "summary": {"single": {"gsm8k": summary}, "batched": {}},
            "environment": {},
            "model": "m",
            "banks": "b",
        }
    )
    assert "no (use_mtp 0, EntMTP 1 differ)" in table


def test_the_drafting_vocabulary_is_timed_against_the_whole_vocabulary(mtp_folder):
    """The LM-head cost: the drafter over its drafting vocabulary and over all of it (use_mtp=True's), fitted and
    the product alone, in results.json and summary.md; nothing to compare where it drafts over all of it."""
    script = _script()
    model, _ = layout.load_mtp_checkpoint(mtp_folder)
    vocab = model.config.vocab_size
    enable_entmtp(model, layout.mtp_drafter(model, mtp_folder, draft_vocab=list(range(vocab // 2))))
    costs = script.drafting_costs(model)
    assert (costs["draft_vocab_rows"], costs["vocab_rows"]) == (vocab // 2, vocab)
    for v in (costs["draft_vocab"], costs["full_vocab"]):
        assert len(v["fit_ms"]) == 3 and v["fit_error"] >= 0 and v["lm_head_8_nodes_ms"] > 0
    summary = {"single": {}, "batched": {}}
    settings = {"n": 1, "max_new_tokens": 4, "repeats": 1}
    results = {"settings": settings, "summary": summary, "environment": {}, "model": "m", "banks": "b"}
    table = script.table({**results, "drafting_costs": costs})
    assert f"| {vocab // 2} |" in table and f"| {vocab} |" in table
    enable_entmtp(model, "mtp")
    assert script.drafting_costs(model) is None
