"""Benchmark runner, perplexity metric and regime helpers on a tiny random model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from entmtp_hf.banks.bank import shipped_bank_path
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.demo.compare import find_mismatch
from entmtp_hf.heads import HydraHeads
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.tools import regime
from entmtp_hf.tools.bench.context import BenchContext, random_heads
from entmtp_hf.tools.bench.methods import METHODS, Generation, Method
from entmtp_hf.tools.bench.report import table1_markdown, write_report
from entmtp_hf.tools.bench.results import read_results, write_results
from entmtp_hf.tools.bench.runner import rotation, run_benchmark
from entmtp_hf.tools.bench.settings import BenchSettings
from entmtp_hf.tools.bench.summary import geomean, summarize
from entmtp_hf.tools.data.tasks import evaluation_basket
from entmtp_hf.tools.metrics import load_perplexity

DEFAULTS = shipped_bank_path("published-defaults")
WORDS = ["<s>", "</s>", "[UNK]"] + [f"w{i}" for i in range(45)]
V = len(WORDS)
N_PROMPTS, NEW_TOKENS = 2, 8
BROAD = ("vanilla-onednn", "medusa-default", "entmtp-ladder", "entmtp-tau-retrieval", "eagle-default", "eagle-static")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def tiny_llama(seed: int = 0, zero_head: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.0 if zero_head else 4.0)
    model.generation_config.eos_token_id = None
    return model


def write_task(folder: Path, name: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    path = folder / f"{name}.jsonl"
    rows = [{"prompt": " ".join(f"w{int(i)}" for i in rng.integers(0, 45, 6 + k))} for k in range(8)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


class Planted(Method):
    """Vanilla with token 3 of every output changed; counts its generate calls."""

    calls = 0

    def prepare(self, ctx, task, mode):
        vanilla = METHODS["vanilla"].prepare(ctx, task, mode)

        def run(input_ids, kwargs):
            Planted.calls += 1
            gen = vanilla(input_ids, kwargs)
            ids = list(gen.new_ids)
            ids[3] = (ids[3] + 1) % V
            return Generation(ids, None)

        return run


class CountingClock:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.calls * 0.5  # every measured interval lasts 0.5 "seconds"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    tasks = (write_task(folder, "alpha", 1), write_task(folder, "beta", 2))
    model, tok = tiny_llama(), tiny_tokenizer()
    ctx = BenchContext(model, tok, bank_folder=DEFAULTS, model_name="tiny", family_banks={"eagle": Path(DEFAULTS)})
    for family in ("hydra", "medusa", "eagle"):
        ctx.heads[family] = random_heads(model, family, seed=0)
    clock = CountingClock()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(METHODS, "planted", Planted("planted", "vanilla with a planted change", default=False))
        # the default methods and the opt-in ones that share their machinery (the published-defaults
        # bank lists no value trees: entmtp-value is checked on its own below)
        names = (*(n for n, m in METHODS.items() if m.default), *BROAD, "planted")
        settings = BenchSettings(
            tasks=tasks, num_prompts=N_PROMPTS, max_new_tokens=NEW_TOKENS, preset="test", methods=names, warmup_tokens=4
        )
        Planted.calls = 0
        results = run_benchmark(ctx, settings, clock=clock, out_path=folder / "results.json")
    return results, clock, Planted.calls, folder, ctx


# ----------------------------------------------------------------------------- basket and runner
def test_basket_is_deterministic(tmp_path):
    path = write_task(tmp_path, "gamma", 3)
    a, b = evaluation_basket(path, 4), evaluation_basket(path, 4)
    assert [p.prompt_id for p in a] == [p.prompt_id for p in b] and [p.messages for p in a] == [p.messages for p in b]
    tok = tiny_tokenizer()
    assert [p.render(tok) for p in a] == [p.render(tok) for p in b]
    g1, g2 = evaluation_basket("gsm8k", 3), evaluation_basket("gsm8k", 3)
    assert [p.prompt_id for p in g1] == [p.prompt_id for p in g2]


def test_warmup_not_timed(bench_run):
    results, clock, planted_calls, _, _ = bench_run
    records = results["records"]
    assert clock.calls == 2 * len(records)  # the clock is read only around measured generations
    assert all(r["time_s"] == pytest.approx(0.5) for r in records)
    planted = [r for r in records if r["method"] == "planted"]
    tasks = {r["task"] for r in planted}
    assert planted_calls == len(planted) + len(tasks) > len(planted) + 1  # one unmeasured warm-up per task


def test_methods_are_interleaved_and_rotated(bench_run):
    results = bench_run[0]
    names = list(results["settings"]["methods"])
    records = sorted(results["records"], key=lambda r: r["order"])
    assert [r["order"] for r in records] == list(range(len(records)))
    for task in results["prompts"]:
        for i in range(N_PROMPTS):
            block = [r for r in records if r["task"] == task and r["prompt_index"] == i]
            assert [r["method"] for r in block] == rotation(names, i)
            assert [r["order"] for r in block] == list(range(block[0]["order"], block[0]["order"] + len(names)))
    first = {r["method"] for r in records if r["rotation_position"] == 0}
    assert len(first) > 1


def test_a_family_bank_that_is_missing_is_named(bench_run):
    ctx = bench_run[4]
    saved = dict(ctx.family_banks)
    ctx.family_banks["eagle"] = Path("/nonexistent/eagle-bank")
    try:
        reason = METHODS["eagle-static"].unavailable(ctx, "gamma", "greedy")
    finally:
        ctx.family_banks.update(saved)
    assert "no eagle bank at /nonexistent/eagle-bank" in reason


def test_value_method_needs_a_bank_with_value_trees(bench_run):
    ctx = bench_run[4]
    assert "lists no trees for the value policy" in METHODS["entmtp-value"].unavailable(ctx, "alpha", "greedy")


def test_json_has_every_method_and_task(bench_run):
    results, _, _, folder, _ = bench_run
    data = read_results(folder / "results.json")
    names = data["settings"]["methods"]
    assert set(data["prompts"]) == {"alpha", "beta"} and not data["skipped"]
    for task in data["prompts"]:
        for m in names:
            recs = [r for r in data["records"] if r["task"] == task and r["method"] == m]
            assert len(recs) == N_PROMPTS
            assert all(r["new_tokens"] == NEW_TOKENS and r["perplexity"] > 1 for r in recs)
        assert set(data["summary"][task]) == set(names)
    env = data["environment"]
    assert {"versions", "cpu_model", "torch_threads", "date_utc", "git_commit"} <= set(env)
    tree = [r for r in data["records"] if r["method"] == "hydra-default"]
    assert all(r["accept_lengths"] and r["drafted_tokens"] == 63 * r["steps"] for r in tree)
    assert all(r["speedup"] == pytest.approx(1.0) for r in data["records"])  # fake clock: equal times
    table = table1_markdown(data)
    assert all(m in table.splitlines()[0] for m in names) and "| alpha |" in table
    paths = write_report(folder / "results.json", folder / "report", results_md=folder / "docs" / "results.md")
    assert paths["tokens/s per method and task"].stat().st_size > 0 and paths["accept-length histograms"].exists()
    assert "tokens_per_s.png" in paths["results_md"].read_text()


def test_split_tasks_merge_into_one_report(bench_run, tmp_path):
    """The basket's tasks run in two processes (one per core) merge back into one results file."""
    from entmtp_hf.tools.bench.results import merge_results

    results = bench_run[0]
    parts = []
    for task in ("alpha", "beta"):
        part = json.loads(json.dumps(results))
        part["settings"]["tasks"] = [task]
        part["prompts"] = {task: part["prompts"][task]}
        part["records"] = [r for r in part["records"] if r["task"] == task]
        part["environment"]["argv"] = ["entmtp-hf", "bench", "--tasks", task]
        parts.append(write_results(part, tmp_path / task / "results.json"))
    paths = write_report(parts, tmp_path / "merged", results_md=tmp_path / "results.md")
    merged = read_results(paths["results"])
    assert merged["settings"]["tasks"] == ["alpha", "beta"] and merged["records"] == results["records"]
    assert merged["summary"] == json.loads(json.dumps(summarize(results)))
    text = paths["results_md"].read_text()
    assert "--tasks alpha" in text and "--tasks beta" in text
    other = json.loads(json.dumps(read_results(parts[1])))
    other["settings"]["max_new_tokens"] += 1
    with pytest.raises(ValueError, match="max_new_tokens"):
        merge_results([read_results(parts[0]), other])
    with pytest.raises(ValueError, match="repeats tasks"):
        merge_results([read_results(parts[0]), read_results(parts[0])])
    with pytest.raises(ValueError, match="--out"):
        write_report(parts)


def test_resume_runs_only_incomplete_prompts(bench_run):
    results, _, _, _, ctx = bench_run
    partial = json.loads(json.dumps(results))
    partial["records"] = [r for r in partial["records"] if not (r["task"] == "beta" and r["prompt_index"] == 1)]
    settings = BenchSettings(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in results["settings"].items() if k != "methods"},
        methods=tuple(m for m in results["settings"]["methods"] if m != "planted"),
    )
    partial["settings"]["methods"] = list(settings.methods)
    partial["records"] = [r for r in partial["records"] if r["method"] != "planted"]
    clock = CountingClock()
    resumed = run_benchmark(ctx, settings, clock=clock, resume=partial)
    assert clock.calls == 2 * len(settings.methods) and resumed["resumed"]["prompts"] == 2 * N_PROMPTS - 1
    assert len(resumed["records"]) == 2 * N_PROMPTS * len(settings.methods)
    with pytest.raises(ValueError, match="cannot resume"):
        run_benchmark(ctx, BenchSettings(tasks=settings.tasks, num_prompts=1, max_new_tokens=4), resume=partial)


def test_greedy_outputs_checked_against_vanilla(bench_run):
    results = bench_run[0]
    for r in results["records"]:
        if r["method"] == "planted":
            m = r["mismatch"]
            assert m["position"] == 3 and m["token"] == (m["reference_token"] + 1) % V
            assert m["logit_gap"] is not None and m["logit_gap"] > 0  # vanilla's token is the argmax
        else:  # float64: every method is lossless
            assert r["mismatch"] is None, (r["method"], r["mismatch"])
    counts = {t: s["planted"]["mismatches"] for t, s in results["summary"].items()}
    assert counts == {"alpha": N_PROMPTS, "beta": N_PROMPTS}


def test_find_mismatch_logit_gap():
    model = tiny_llama(seed=3)
    prompt = [5, 6, 7]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, 3:].tolist()
    other = ref[:2] + [(ref[2] + 7) % V] + ref[3:]
    m = find_mismatch(ref, other, model, prompt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:2]])).logits[0, -1]
    assert m["position"] == 2 and m["logit_gap"] == pytest.approx(float(logits[ref[2]] - logits[other[2]]))
    assert find_mismatch(ref, list(ref)) is None
    assert find_mismatch(ref, ref[:3])["position"] == 3


def test_mismatch_gap_is_read_from_the_methods_own_model():
    """A method on a bf16 copy diverges at bf16's ties: its gap must come from that copy, not the fp32 model."""
    from types import SimpleNamespace

    from entmtp_hf.tools.bench.checks import postprocess

    fp32, other_model = tiny_llama(seed=3), tiny_llama(seed=4)
    prompt = [5, 6, 7]
    with torch.no_grad():
        ref = fp32.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    out = ref[:1] + [(ref[1] + 7) % V] + ref[2:]
    records = [
        {"task": "t", "method": m, "prompt_index": 0, "tokens_per_s": 1.0, "output_ids": ids}
        for m, ids in (("vanilla", ref), ("low", out))
    ]
    ctx, settings = SimpleNamespace(model=fp32), SimpleNamespace(mode="greedy", perplexity=False)
    postprocess(ctx, records, [{"input_ids": prompt}], settings, {}, {"low": other_model})
    with torch.no_grad():
        logits = other_model(torch.tensor([prompt + ref[:1]])).logits[0, -1]
    assert records[1]["mismatch"]["logit_gap"] == pytest.approx(float(logits[ref[1]] - logits[out[1]]))
    assert records[0]["mismatch"] is None


def test_unavailable_methods_are_skipped_with_reason(tmp_path):
    model, tok = tiny_llama(), tiny_tokenizer()
    ctx = BenchContext(model, tok, bank_folder=DEFAULTS, missing_heads={"medusa": "no medusa heads here"})
    ctx.heads["hydra"] = random_heads(model, "hydra")
    settings = BenchSettings(
        tasks=(write_task(tmp_path, "delta", 4),),
        num_prompts=1,
        max_new_tokens=4,
        methods=("vanilla", "medusa-default", "entmtp-static"),
        perplexity=False,
    )
    results = run_benchmark(ctx, settings)
    assert results["skipped"] == {"medusa-default": {"delta": "no medusa heads here"}}
    assert {r["method"] for r in results["records"]} == {"vanilla", "entmtp-static"}
    assert "| delta | " in table1_markdown(results | {"summary": summarize(results)})


def test_packed_methods_pack_outside_the_clock_and_unpack_before_the_next_method(tmp_path):
    """``vanilla-packed`` and ``entmtp-static-packed`` run with the decoder's layers packed (float32:
    oneDNN takes it), every other method on the dense weights, which come back bit for bit; on a
    float64 model there is nothing to pack and the methods are skipped with the reason."""
    model, tok = tiny_llama().float(), tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = BenchContext(model, tok, bank_folder=DEFAULTS, heads={"hydra": random_heads(model, "hydra").float()})
    seen = []

    class Spy(Method):  # vanilla, noting whether every weight is dense when it runs
        def prepare(self, ctx_, task, mode):
            run = super().prepare(ctx_, task, mode)
            return lambda ids, kw: seen.append(all(p.numel() for p in model.parameters())) or run(ids, kw)

    names = ("vanilla", "vanilla-packed", "entmtp-static", "entmtp-static-packed")
    settings = BenchSettings(
        tasks=(write_task(tmp_path, "zeta", 6),), num_prompts=2, max_new_tokens=8, methods=names, perplexity=False
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(METHODS, "vanilla", Spy("vanilla", "plain generate, watched"))
        results = run_benchmark(ctx, settings)
    assert not results["skipped"] and {r["method"] for r in results["records"]} == set(names)
    assert all(r["mismatch"] is None for r in results["records"]) and seen and all(seen)
    after = model.state_dict()  # the heads have joined the model since: compare the model's own
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    ctx64 = BenchContext(tiny_llama(), tok, bank_folder=DEFAULTS)
    results = run_benchmark(
        ctx64,
        BenchSettings(
            tasks=settings.tasks,
            num_prompts=1,
            max_new_tokens=4,
            methods=("vanilla", "vanilla-packed"),
            perplexity=False,
        ),
    )
    assert "no layer of the model could be packed" in results["skipped"]["vanilla-packed"]["zeta"]


def test_kernels_are_measured_once_and_applied_only_in_the_calls_that_use_them(tmp_path, monkeypatch):
    """EntMTP methods run on the measured CPU kernels as ``enable_entmtp``'s default does (float32:
    oneDNN takes it), ``entmtp-static-mkl`` without them, ``vanilla-kernels`` is plain generate on
    them; each set is measured once per context (model and heads), and plain ``vanilla`` runs
    ``F.linear`` throughout on weights that never change. On a float64 model the kernels stay off
    and the methods run without them."""
    import entmtp_hf.cpu_kernels as K
    import entmtp_hf.tools.bench.context as context

    built = []

    class Counted(context.CPUKernels):
        def __init__(self, *args, **kwargs):
            built.append(args[1:])
            super().__init__(*args, **kwargs, rows=(1, 2, 4), repeats=1)

    monkeypatch.setattr(context, "CPUKernels", Counted)
    # oneDNN measured fastest everywhere: some layer is routed whatever this machine's timings
    monkeypatch.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "onednn") for c in choices})
    model, tok = tiny_llama().float(), tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    heads = random_heads(model, "hydra").float()
    ctx = BenchContext(model, tok, bank_folder=DEFAULTS, heads={"hydra": heads})
    seen, mkl = [], []

    def applied_here() -> bool:
        return any(isinstance(f := vars(m).get("forward"), K._Dispatch) and f.owner.active() for m in model.modules())

    class Spy(Method):  # notes whether any layer runs a measured kernel in its timed call
        def prepare(self, ctx_, task, mode):
            run = super().prepare(ctx_, task, mode)
            return lambda ids, kw: seen.append(applied_here()) or run(ids, kw)

    kernel_calls = []

    class SpyKernels(METHODS["vanilla-kernels"].__class__):
        def prepare(self, ctx_, task, mode):
            run = super().prepare(ctx_, task, mode)
            return lambda ids, kw: kernel_calls.append(applied_here()) or run(ids, kw)

    class SpyMKL(Method):
        def prepare(self, ctx_, task, mode):
            run = super().prepare(ctx_, task, mode)
            return lambda ids, kw: mkl.append(K.kernels_of(model)) or run(ids, kw)

    names = ("vanilla", "vanilla-kernels", "entmtp-static", "entmtp-static-mkl")
    settings = BenchSettings(
        tasks=(write_task(tmp_path, "theta", 7),), num_prompts=2, max_new_tokens=8, methods=names, perplexity=False
    )
    monkeypatch.setitem(METHODS, "vanilla", Spy("vanilla", "plain generate, watched"))
    monkeypatch.setitem(METHODS, "vanilla-kernels", SpyKernels("vanilla-kernels", "plain generate on the kernels"))
    mkl_method = METHODS["entmtp-static-mkl"]
    monkeypatch.setitem(
        METHODS,
        "entmtp-static-mkl",
        SpyMKL(**{f.name: getattr(mkl_method, f.name) for f in dataclasses.fields(mkl_method)}),
    )
    results = run_benchmark(ctx, settings)
    assert not results["skipped"] and {r["method"] for r in results["records"]} == set(names)
    assert len(built) == 2 and set(ctx._kernels) == {(id(model), id(None)), (id(model), id(heads))}
    assert all(k.active for k in ctx._kernels.values())
    assert set(results["environment"]["cpu_kernels"]) == {"model", "hydra"}
    assert seen and not any(seen) and mkl and not any(mkl) and kernel_calls and all(kernel_calls)
    after = model.state_dict()  # the heads have joined the model since: compare the model's own
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    ctx64 = BenchContext(tiny_llama(), tok, bank_folder=DEFAULTS)
    results = run_benchmark(
        ctx64,
        BenchSettings(
            tasks=settings.tasks,
            num_prompts=1,
            max_new_tokens=4,
            methods=("vanilla", "vanilla-kernels"),
            perplexity=False,
        ),
    )
    assert not results["skipped"] and len(results["records"]) == 2
    assert (
        not any(k.active for k in ctx64._kernels.values()) and "off" in results["environment"]["cpu_kernels"]["model"]
    )


def test_one_progress_bar_counts_every_measured_generation(tmp_path, capsys):
    model, tok = tiny_llama(), tiny_tokenizer()
    ctx = BenchContext(
        model,
        tok,
        bank_folder=DEFAULTS,
        heads={"hydra": random_heads(model, "hydra")},
        missing_heads={"medusa": "no medusa heads here"},
    )
    tasks = (write_task(tmp_path, "iota", 8), write_task(tmp_path, "kappa", 9))
    settings = BenchSettings(
        tasks=tasks,
        num_prompts=2,
        max_new_tokens=4,
        perplexity=False,
        methods=("vanilla", "medusa-default", "entmtp-static"),
    )
    results = run_benchmark(ctx, settings, progress=True)
    err = capsys.readouterr().err
    assert len(results["records"]) == 2 * 2 * 2  # medusa-default skipped: the bar's total shrinks with it
    assert "bench: 100%" in err and "8/8" in err and "kappa entmtp-static" in err and "12/12" not in err


@pytest.mark.parametrize("mode", ["sampling", "typical"])
def test_sampling_modes_run(tmp_path, mode):
    model, tok = tiny_llama(), tiny_tokenizer()
    ctx = BenchContext(model, tok, bank_folder=DEFAULTS, heads={"hydra": random_heads(model, "hydra")})
    settings = BenchSettings(
        tasks=(write_task(tmp_path, "eps", 5),),
        num_prompts=2,
        max_new_tokens=6,
        mode=mode,
        methods=("vanilla", "pld", "hydra-default", "entmtp-tau"),
        perplexity=False,
    )
    results = run_benchmark(ctx, settings)
    assert not results["skipped"] and len(results["records"]) == 8
    assert all(r["mismatch"] is None and r["new_tokens"] == 6 for r in results["records"])  # no greedy check


# ----------------------------------------------------------------------------- perplexity metric
def test_perplexity_of_uniform_model_is_vocab_size(tmp_path):
    model, tok = tiny_llama(zero_head=True), tiny_tokenizer()
    assert tok.pad_token is None
    metric = load_perplexity()
    texts = ["w1 w2 w3 w4", "w5"]
    res = metric.compute(predictions=texts, model=model, tokenizer=tok, batch_size=2)
    assert res["perplexities"] == pytest.approx([V, V], rel=1e-9) and res["mean_perplexity"] == pytest.approx(V)
    res = metric.compute(predictions=texts, contexts=["w9 w8", "w7 w6 w5"], model=model, tokenizer=tok)
    assert res["perplexities"] == pytest.approx([V, V], rel=1e-9)
    model.float().save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    res = metric.compute(predictions=texts, model_id=str(tmp_path / "m"), device="cpu")
    assert res["perplexities"] == pytest.approx([V, V], rel=1e-5)


def test_perplexity_loads_offline_from_the_package(monkeypatch):
    """The shipped metric folder loads with every network connection refused (as from a wheel)."""
    import socket

    def refuse(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    load_perplexity.cache_clear()
    metric = load_perplexity()
    assert load_perplexity() is metric  # loaded once
    model, tok = tiny_llama(zero_head=True), tiny_tokenizer()
    res = metric.compute(predictions=["w1 w2 w3"], contexts=["w4 w5"], model=model, tokenizer=tok)
    assert res["perplexities"] == pytest.approx([V], rel=1e-9)


def test_perplexity_matches_direct_nll():
    model, tok = tiny_llama(seed=5), tiny_tokenizer()
    metric = load_perplexity()
    ids = tok("w3 w4 w5 w6", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[0] + ids])).logits[0].double(), -1)
    nll = -sum(float(logp[i, t]) for i, t in enumerate(ids))
    res = metric.compute(predictions=["w3 w4 w5 w6"], model=model, tokenizer=tok)
    assert res["perplexities"][0] == pytest.approx(np.exp(nll / len(ids)), rel=1e-9)


# ----------------------------------------------------------------------------- regime helpers
def test_pearson_and_auroc_on_synthetic_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=500)
    y = 2 * x + rng.normal(scale=0.5, size=500)
    assert regime.pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert regime.pearson([1, 2, np.nan, 4], [2, 4, 5, 8]) == pytest.approx(1.0)
    assert np.isnan(regime.pearson([1, 1, 1], [1, 2, 3]))
    labels = np.array([0, 0, 1, 1])
    assert regime.auroc([0.1, 0.2, 0.8, 0.9], labels) == 1.0
    assert regime.auroc([0.9, 0.8, 0.2, 0.1], labels) == 0.0
    assert regime.auroc([0.5, 0.5, 0.5, 0.5], labels) == 0.5
    assert regime.auroc([0.1, 0.6, 0.6, 0.9], labels) == pytest.approx(0.875)
    assert np.isnan(regime.auroc([0.1, 0.2], [1, 1]))


def test_split_is_by_sample_and_mlp_learns():
    rng = np.random.default_rng(1)
    groups = [f"s{i}" for i in range(20) for _ in range(30)]
    x = rng.normal(size=(600, 3))
    y = (x[:, 0] + 0.3 * rng.normal(size=600) > 0).astype(float)
    train, test = regime.split_by_sample(groups)
    g = np.array(groups)
    assert not set(g[train]) & set(g[test]) and train.sum() + test.sum() == 600
    for s in set(groups):  # every sample lies wholly on one side
        assert len(set(test[g == s])) == 1
    with pytest.raises(ValueError, match="by sample"):
        regime.check_disjoint(["s1", "s2"], ["s2", "s3"])
    with pytest.raises(ValueError, match=">= 2 samples"):
        regime.split_by_sample(["s1"] * 5)
    res = regime.mlp_auroc(x, y, groups, epochs=100)
    assert res["auroc"] > 0.9 and res["train_samples"] + res["test_samples"] == 20


def bigram_heads(model, seq: list[int]):
    """Hydra heads that draft ``successor[last token]`` of ``seq`` (exact on repeating text).

    Head i's block passes the embedding of the last token on its path through unchanged
    and its LM head maps embeddings to successors (least squares on the tokens of ``seq``).
    """
    heads = HydraHeads.for_model(model, num_heads=4).double()
    emb = model.get_input_embeddings().weight.detach()
    h = emb.shape[1]
    succ = dict(zip(seq, seq[1:]))
    toks = sorted(succ)
    target = torch.zeros(len(toks), V, dtype=torch.float64)
    target[range(len(toks)), [succ[t] for t in toks]] = 8.0
    weight = (torch.linalg.pinv(emb[toks]) @ target).T
    with torch.no_grad():
        for i, blocks in enumerate(heads.mlps):
            block = blocks[0]
            for p in (block.linear.weight, block.linear.bias, block.res_connection.weight, block.res_connection.bias):
                p.zero_()
            block.res_connection.weight[:, (i + 1) * h : (i + 2) * h] = torch.eye(h)
            heads.lm_heads[i].weight.copy_(weight)
            heads.lm_heads[i].bias.zero_()
    return heads.eval()


def test_trace_rebuilds_the_scheduler_feature():
    """The traced chain value equals the one the decode loop fed its scheduler, step by step."""
    model, prompt = tiny_llama(seed=0), [3, 1, 4, 1, 5]
    seq = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0].tolist()
    heads = bigram_heads(model, seq)
    enable_entmtp(model, heads)
    chain = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    cfg = EntMTPConfig(trees=[[[0]], chain], policy="hysteresis", feature="chain_value", tau_on=0.0, tau_off=0.0)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=40, do_sample=False, entmtp_config=cfg, return_dict_in_generate=True
    )
    stats = out.entmtp_stats
    assert out.sequences[0].tolist() == seq and len(set(stats["accept_lengths"])) > 1
    feats, acc = regime.trace_generation(model, heads, prompt, seq[len(prompt) :], stats["accept_lengths"])
    assert acc.tolist() == stats["accept_lengths"][:-1]
    col = regime.FEATURES.index("chain_value")
    np.testing.assert_allclose(feats[:, col], stats["features"][:-1], rtol=1e-9)
    analysis = regime.analyse([regime.Trace("t", f"s{i}", "m", feats, acc) for i in range(3)])
    assert set(analysis["t"]["pearson"]) == set(regime.FEATURES)


def test_regime_on_bench_records(bench_run, tmp_path):
    results, _, _, _, ctx = bench_run
    doc = regime.analyse_results(results, ctx, tmp_path, methods=("entmtp-static", "hydra-default"))
    assert set(doc["tasks"]) == {"alpha", "beta"} and (tmp_path / "regime_heatmap.png").exists()
    md = regime.regime_markdown(json.loads((tmp_path / "regime.json").read_text()))
    assert "MLP AUROC" in md and "### entmtp-static" in md and "### hydra-default" in md
    for task, pooled in doc["tasks"].items():  # each method alone, and the pooled table adds them up
        assert sum(doc["by_method"][m][task]["steps"] for m in ("entmtp-static", "hydra-default")) == pooled["steps"]
    one = regime.analyse_results(results, ctx, tmp_path / "one", methods=("entmtp-static",))
    assert one["by_method"] == {} and "###" not in regime.regime_markdown(one)


def test_geomean_and_write_roundtrip(tmp_path):
    assert geomean([1.0, 4.0]) == pytest.approx(2.0) and geomean([]) is None
    doc = {"format": "entmtp-bench", "format_version": 1, "x": float("nan")}
    assert read_results(write_results(doc, tmp_path / "r.json"))["x"] is None


def test_speculation_table_reports_speedup_and_waste():
    from entmtp_hf.tools.bench.report import speculation_markdown

    def rec(m, sp, steps, d, a):
        return {
            "task": "t",
            "method": m,
            "new_tokens": 21,
            "time_s": 1.0,
            "steps": steps,
            "speedup": sp,
            "drafted_tokens": d,
            "accepted_draft_tokens": a,
        }

    results = {
        "prompts": {"t": []},
        "settings": {"methods": ["vanilla", "chain-4", "eas"]},
        "records": [rec("vanilla", 1.0, 20, None, None), rec("chain-4", 1.2, 10, 40, 10), rec("eas", 1.5, 8, 12, 9)],
    }
    md = speculation_markdown(results)
    assert "| t | chain-4 | 1.20× | 2.00 | 4.00 | 25.0% | 75.0% |" in md
    assert "| t | eas | 1.50× | 2.50 | 1.50 | 75.0% | 25.0% |" in md and "vanilla" not in md


def test_eas_table_pools_chains_and_halts():
    from entmtp_hf.tools.bench.report import eas_markdown

    def rec(task, chains, halts, v, a):
        return {
            "task": task,
            "method": "eas",
            "eas": {
                "chain_lengths": chains,
                "halts": halts,
                "verified_draft_tokens": v,
                "accepted_draft_tokens": a,
            },
        }

    results = {
        "records": [
            rec("t", [4, 2], {"warmup": 1, "threshold": 1}, 6, 3),
            rec("t", [0], {"threshold": 1}, 0, 0),
            {"task": "t", "method": "vanilla"},
        ]
    }
    md = eas_markdown(results)
    assert "| t | eas | 3 | 2.00 | warmup 1, threshold 2 | 50.0% |" in md
    assert eas_markdown({"records": [{"task": "t", "method": "vanilla"}]}) == ""


def test_pairwise_table_pairs_prompts_and_bounds_the_noise():
    from entmtp_hf.tools.bench.report import pairwise_markdown
    from entmtp_hf.tools.bench.summary import bootstrap_interval, paired_ratios

    def rec(m, i, tps, steps):
        return {"task": "t", "method": m, "prompt_index": i, "new_tokens": 21, "tokens_per_s": tps, "steps": steps}

    noisy = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]  # per-prompt drift shared by both methods of a round
    records = [rec("vanilla", i, 10 * d, 20) for i, d in enumerate(noisy)]
    records += [rec("entmtp-static", i, 15 * d, 10) for i, d in enumerate(noisy)]
    records += [rec("entmtp-tau", i, 15 * d * (1.05 if i % 2 else 0.97), 8) for i, d in enumerate(noisy)]
    results = {
        "prompts": {"t": []},
        "settings": {"methods": ["vanilla", "entmtp-static", "entmtp-tau"]},
        "records": records,
    }
    pairs = paired_ratios(results, "t", "entmtp-static", "entmtp-tau")
    assert [round(p[0], 2) for p in pairs] == [0.97, 1.05] * 3 and all(p[1] == pytest.approx(1.25) for p in pairs)
    lo, hi = bootstrap_interval([p[0] for p in pairs])
    assert lo < geomean([p[0] for p in pairs]) < hi and 0.97 <= lo < 1.0 < hi <= 1.05
    assert bootstrap_interval([1.1] * 5) == pytest.approx((1.1, 1.1)) and bootstrap_interval([1.0, 2.0]) is None
    md = pairwise_markdown(results)
    assert "| t | entmtp-tau | 6 |" in md and "1.250×" in md and "vanilla |" not in md
    assert pairwise_markdown(results, reference="absent") == ""


def test_the_kernel_reference_gets_its_own_prompt_by_prompt_table():
    """Tree methods over plain decoding with oneDNN's kernels (no steps: one token per step)."""
    from entmtp_hf.tools.bench.report import KERNEL_REFERENCE, pairwise_markdown
    from entmtp_hf.tools.bench.summary import paired_ratios

    def rec(m, i, tps, steps=None):
        return {"task": "t", "method": m, "prompt_index": i, "new_tokens": 21, "tokens_per_s": tps, "steps": steps}

    records = [rec("vanilla", i, 10.0) for i in range(4)] + [rec(KERNEL_REFERENCE, i, 12.5) for i in range(4)]
    records += [rec("entmtp-static", i, 15.0, 10) for i in range(4)]
    results = {
        "prompts": {"t": []},
        "settings": {"methods": ["vanilla", KERNEL_REFERENCE, "entmtp-static"]},
        "records": records,
    }
    assert [p[0] for p in paired_ratios(results, "t", KERNEL_REFERENCE, "entmtp-static")] == [1.2] * 4
    md = pairwise_markdown(results, KERNEL_REFERENCE)
    assert "| t | entmtp-static | 4 | 1.200× |" in md and "2.000×" in md and "| vanilla |" not in md
    assert KERNEL_REFERENCE not in pairwise_markdown(results).split("|---|")[-1]  # not a row against EntMTP*


# ----------------------------------------------------------------------------- batched
def test_batched_bench_groups_interleaves_and_checks_every_row(tmp_path):
    from entmtp_hf.tools.bench.batched import batched_plot, batched_table, run_batched

    tasks = (write_task(tmp_path, "alpha", 1),)
    model, tok = tiny_llama(), tiny_tokenizer()
    ctx = BenchContext(model, tok, bank_folder=DEFAULTS, model_name="tiny")
    ctx.heads["hydra"] = random_heads(model, "hydra", seed=0)
    settings = BenchSettings(
        tasks=tasks,
        num_prompts=5,
        max_new_tokens=8,
        preset="test",
        methods=("vanilla", "hydra-default", "pld"),
        warmup_tokens=2,
    )
    results = run_batched(ctx, settings, [1, 2], progress=False, out_path=tmp_path / "results.json")
    assert results["skipped"] == {"pld": "transformers' assisted decoding takes one prompt"}
    recs = results["records"]
    by_b = {b: [r for r in recs if r["batch_size"] == b] for b in (1, 2)}
    assert len(by_b[1]) == 5 * 2 and len(by_b[2]) == 2 * 2  # the incomplete group of 1 is left out at B = 2
    assert all(len(r["rows"]) == r["batch_size"] for r in recs)
    orders = [[r["method"] for r in by_b[2] if r["group"] == g] for g in (0, 1)]
    assert orders == [["vanilla", "hydra-default"], ["hydra-default", "vanilla"]]  # rotated per group
    task = recs[0]["task"]
    for b in ("1", "2"):
        s = results["summary"][task][b]["hydra-default"]
        assert s["rows_identical"] == s["rows"] and s["median_ratio_to_vanilla"] > 0
    assert "| 2 |" in batched_table(results) and batched_plot(results, tmp_path / "p.png").is_file()
    from entmtp_hf.tools.cli import main

    assert main(["bench-report", str(tmp_path / "results.json"), "--out", str(tmp_path / "report")]) == 0
    assert {p.name for p in (tmp_path / "report").iterdir()} == {
        "table.md",
        "summary.json",
        "throughput_by_batch_size.png",
    }


def test_a_compile_backend_that_is_not_installed_is_skipped_with_its_name(tmp_path):
    from entmtp_hf.tools.bench.methods import CompiledWith, compiled_kwargs

    model, tok = tiny_llama(), tiny_tokenizer()
    ctx = BenchContext(model, tok, bank_folder=DEFAULTS)
    method = CompiledWith(
        "vanilla-nowhere",
        "test",
        generate_kwargs=compiled_kwargs("nowhere"),
        backend_module="entmtp_hf_no_such_backend",
    )
    assert "the entmtp_hf_no_such_backend backend is not installed" in method.unavailable(ctx, "delta", "greedy")
    frozen = compiled_kwargs(freezing=True)["compile_config"]
    assert frozen.options == {"freezing": True} and frozen.mode is None  # torch takes a mode or options, not both
    assert METHODS["vanilla-compiled"].generate_kwargs["compile_config"].mode == "default"


def test_another_demo_model_benchmarks_its_own_shipped_drafter():
    from entmtp_hf.demo import SHIPPED_DRAFTERS
    from entmtp_hf.tools.bench.context import DEFAULT_HEADS, default_drafters

    heads, banks = default_drafters("gemma-3-270m")
    assert heads == {"eagle": SHIPPED_DRAFTERS["gemma-3-270m"][0]} and banks["eagle"].name == "gemma-3-270m-cpu-eagle"
    assert banks["eagle"].is_dir() and default_drafters(None)[0] == DEFAULT_HEADS
