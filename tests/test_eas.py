"""Entropy-adaptive speculation lengths: the rule without a model, then both drafting forms."""

import math

import pytest
import torch
from test_generation import chi_square_p, prompts, target_joint
from tiny import tiny_model
from transformers import LlamaForCausalLM

from entmtp_hf.assisted import ACTIVE_EAS_CALL, EntropyAdaptiveCandidateGenerator
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.scheduling.eas import EASConfig, EASController, entropy_nats
from entmtp_hf.trees.tree import MC_SIM_7B_63

CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
NO_WARMUP = dict(warmup_tokens=0, window=4, fork_min_history=4)


def controller(**kwargs) -> EASController:
    return EASController(EASConfig(**{**NO_WARMUP, **kwargs}))


def fill(ctrl: EASController, value: float, n: int = 4) -> None:
    """Put ``n`` recent draft entropies of ``value`` into the window."""
    ctrl.recent.extend([value] * n)


# ----------------------------------------------------------------------------- the rule
def test_entropy_nats_matches_formula():
    logits = torch.tensor([[2.0, 0.5, -1.0, -1.0], [0.0, -math.inf, -math.inf, -math.inf]])
    p = torch.softmax(logits[0], -1)
    h = entropy_nats(logits)
    assert h[0].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6) and h[1].item() == 0.0


def test_threshold_bands_follow_recent_mean():
    cfg = EASConfig(thresholds=(3.0, 2.0, 1.5), band_edges=(1.0, 2.0))
    assert [cfg.threshold_for(m) for m in (0.2, 1.0, 1.01, 2.0, 2.5)] == [3.0, 3.0, 2.0, 2.0, 1.5]
    assert cfg.threshold_for(None) == 1.5  # nothing seen yet: the most cautious band
    ctrl = controller(k_max=8)
    seen = []
    for level in (0.5, 1.5, 2.8, 0.3):  # confident -> medium -> unsure -> confident context
        fill(ctrl, level)
        seen.append(ctrl.start_chain().threshold)
    assert seen == [3.0, 2.0, 1.5, 3.0]
    ctrl = controller(window=2, fork_min_history=2)  # only the last `window` entropies count
    fill(ctrl, 2.5, n=2)
    fill(ctrl, 0.1, n=2)
    assert ctrl.recent_mean() == pytest.approx(0.1) and ctrl.start_chain().threshold == 3.0


@pytest.mark.parametrize(
    "entropies, length",
    [([0.1, 0.2, 2.5, 0.1, 0.1], 2), ([2.1, 0.1], 0), ([0.1, 2.0, 2.0, 3.0], 3), ([0.1] * 5, 5)],
)
def test_halts_exactly_at_first_token_over_threshold(entropies, length):
    ctrl = controller(k_max=5, detect_forks=False, window=16)
    fill(ctrl, 1.5)  # medium band: tau = 2.0
    assert ctrl.start_chain().threshold == 2.0
    assert ctrl.chain_length(entropies) == length
    cause = "threshold" if length < 5 else "k_max"
    assert ctrl.stats.chain_lengths[-1] == length and ctrl.stats.halts[cause] == 1
    # the halting token's entropy is examined (it enters the window), later ones are not
    assert list(ctrl.recent)[-(length + (cause == "threshold")) :] == entropies[: length + (cause == "threshold")]


def test_fork_halts_on_a_spike_below_the_threshold():
    ctrl = controller(k_max=6, fork_margin=1.5, fork_ratio=2.0)
    fill(ctrl, 0.3)  # confident context: tau = 3.0, fork level max(0.3 + 1.5, 2 * 0.3) = 1.8
    rule = ctrl.start_chain()
    assert rule.threshold == 3.0 and rule.fork_level == pytest.approx(1.8)
    assert ctrl.chain_length([0.2, 0.4, 1.9, 0.1]) == 2 and ctrl.stats.halts["fork"] == 1
    ctrl = controller(k_max=6, fork_margin=1.5, fork_ratio=2.0)
    fill(ctrl, 0.3)
    assert ctrl.chain_length([0.2, 1.7, 0.1]) == 3 and ctrl.stats.halts["fork"] == 0  # under the fork level
    off = controller(k_max=6, detect_forks=False)
    fill(off, 0.3)
    assert off.chain_length([0.2, 0.4, 1.9, 0.1]) == 4
    young = controller(k_max=6, window=8, fork_min_history=8)  # too little history for forks
    fill(young, 0.3, n=4)
    assert young.start_chain().fork_level is None


def test_warmup_uses_the_fixed_length():
    ctrl = EASController(EASConfig(warmup_tokens=10, warmup_length=3, k_max=8))
    lengths = []
    while ctrl.warming_up:
        lengths.append(ctrl.chain_length([9.0, 9.0, 9.0, 9.0]))  # entropies would halt at once
        ctrl.observe_verified(verified=3, accepted=1, new_tokens=2)
    assert lengths == [3] * 5 and ctrl.stats.halts["warmup"] == 5 and ctrl.stats.thresholds == [None] * 5
    assert ctrl.chain_length([9.0]) == 0 and ctrl.stats.halts["threshold"] == 1  # then the rule applies
    assert ctrl.stats.as_dict()["rejected_fraction"] == pytest.approx(10 / 15)


def test_min_length_exempts_the_first_tokens_from_entropy_halts():
    ctrl = controller(k_max=5, min_length=2, detect_forks=False)
    fill(ctrl, 1.5)  # tau = 2.0
    assert ctrl.chain_length([9.0, 9.0, 9.0, 0.1]) == 2 and ctrl.stats.halts["threshold"] == 1
    assert ctrl.chain_length([0.1, 9.0, 0.1, 0.1, 0.1]) == 5  # the spike is inside the exempt prefix
    assert controller(min_length=1, k_max=1).chain_length([9.0]) == 1


def test_limits_k_max_and_length_budget():
    ctrl = controller(k_max=3)
    fill(ctrl, 0.1)
    assert ctrl.chain_length([0.1] * 6) == 3 and ctrl.stats.halts["k_max"] == 1
    assert ctrl.chain_length([0.1] * 6, limit=2) == 2 and ctrl.stats.halts["length"] == 1
    assert EASController(EASConfig(k_max=12), k_max=4).k_max == 4  # heads: capped at the tree depth


@pytest.mark.parametrize("entropies", [[0.1, 0.2, 2.5, 0.1], [2.1], [0.1] * 6, [0.1, 0.1]])
def test_walk_fed_one_entropy_at_a_time_matches_chain_length(entropies):
    """The lazy form asks for no entropy after the chain has ended and agrees with chain_length."""
    eager, lazy = controller(k_max=4, window=16), controller(k_max=4, window=16)
    fill(eager, 1.5)
    fill(lazy, 1.5)
    walk, fed = lazy.walk(), 0
    for h in entropies:
        fed += 1
        if walk.feed(h):
            break
    assert walk.close() == eager.chain_length(entropies) and lazy.stats == eager.stats
    assert list(lazy.recent) == list(eager.recent)
    assert fed == min(len(entropies), walk.length + (walk.length < 4))  # stopped asking at the halt
    with pytest.raises(RuntimeError, match="ended"):
        walk.feed(0.1)
    assert controller().walk(limit=0).done  # an empty chain needs no entropy at all


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k_max=0), "k_max"),
        (dict(thresholds=(3.0, 2.0)), "band_edges"),
        (dict(band_edges=(2.0, 1.0)), "strictly increasing"),
        (dict(thresholds=(3.0, -1.0, 1.0)), "thresholds"),
        (dict(fork_ratio=0.5), "fork_ratio"),
        (dict(window=4, fork_min_history=8), "fork_min_history"),
        (dict(warmup_length=-1), "warmup_length"),
        (dict(min_length=-1), "min_length"),
        (dict(window=2.5), "window"),
    ],
)
def test_invalid_eas_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EASConfig(**kwargs)


# ----------------------------------------------------------------------------- draft model
@pytest.fixture(scope="module")
def pair():
    """Tiny float64 target and a draft of the same vocabulary: its first layer, LM head sharpened."""
    target = tiny_model("llama", seed=0)
    cfg = target.config.__class__(**{**target.config.to_dict(), "num_hidden_layers": 1})
    draft = LlamaForCausalLM(cfg).double().eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(4.0)  # spread its entropies (argmax unchanged)
    return target, draft


@pytest.fixture
def enabled_target(pair, tiny_cache):
    target, draft = pair
    return enable_entmtp(target, tiny_cache()[1]), draft


DRAFT_CONFIGS = {
    "report": lambda: EASConfig(warmup_tokens=8),
    "bands": lambda: EASConfig(warmup_tokens=0, thresholds=(2.5, 2.3, 2.1), band_edges=(2.0, 2.3), k_max=6),
    "forks": lambda: EASConfig(warmup_tokens=4, thresholds=(3.0, 3.0, 3.0), fork_margin=0.3, fork_ratio=1.0, k_max=6),
}


@pytest.mark.parametrize("name", list(DRAFT_CONFIGS))
def test_draft_model_greedy_identical_to_vanilla(enabled_target, name):
    model, draft = enabled_target
    accepted, halts = 0, {}
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=30, do_sample=False)
        out = model.generate(
            ids,
            max_new_tokens=30,
            do_sample=False,
            assistant_model=draft,
            eas_config=DRAFT_CONFIGS[name](),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, ref)
        st = out.entmtp_stats["eas"]
        assert len(st["chain_lengths"]) == sum(st["halts"].values()) > 0
        accepted += st["accepted_draft_tokens"]
        halts = {k: halts.get(k, 0) + v for k, v in st["halts"].items()}
    assert accepted > 0 and halts["fork" if name == "forks" else "threshold"] > 0
    assert ACTIVE_EAS_CALL.get() is None


def test_draft_chain_halts_at_first_entropy_over_threshold(pair):
    """Recompute the draft's entropies without a cache: the chain stops exactly where the rule says."""
    target, draft = pair
    cfg = EASConfig(warmup_tokens=0, thresholds=(2.0, 1.2, 0.8), band_edges=(1.0, 1.8), k_max=6)
    ctrl = EASController(cfg)
    gen_cfg = target.generation_config.__class__(max_length=200, do_sample=False)
    gen = EntropyAdaptiveCandidateGenerator(prompts(1)[0], draft, gen_cfg, {}, controller=ctrl)
    assert gen.num_drafting_tokens == 6  # the contract's bound on one step's chain (k_max)
    seq, checked = prompts(1)[0], 0
    for _ in range(12):
        rule = ctrl.start_chain()
        cand, logits = gen.get_candidates(seq)
        n = cand.shape[1] - seq.shape[1]
        with torch.no_grad():
            full = draft(cand).logits[0, seq.shape[1] - 1 :]  # the draft's logits before each candidate token
        h = entropy_nats(full)
        if n:  # the candidate logits are the draft's (no processors here) and the tokens their argmax
            assert torch.allclose(logits[0], full[:n].float(), atol=1e-5)
            assert torch.equal(cand[0, seq.shape[1] :], full[:n].argmax(-1))
        assert all(rule.cause_at(i, float(h[i])) is None for i in range(n))
        if n < rule.max_length:
            assert rule.cause_at(n, float(h[n])) in ("threshold", "fork")
            checked += 1
        assert logits is None if n == 0 else logits.shape == (1, n, draft.config.vocab_size)
        # advance along the target's greedy continuation, as verification would
        with torch.no_grad():
            nxt = target(seq).logits[0, -1].argmax()
        gen.update_candidate_strategy(seq, None, 0)
        seq = torch.cat([seq, nxt.view(1, 1)], dim=-1)
    assert checked > 0 and sum(ctrl.stats.halts.values()) == 12


def test_draft_model_sampling_preserves_distribution(enabled_target):
    model, draft = enabled_target
    ids = prompts(1, seed=3)[0]
    probs = target_joint(model, ids, temperature=0.7, top_k=5, length=2)
    n, counts, proposed, accepted = 300, {}, 0, 0  # small: every generate costs ~50 ms on a shared CPU
    torch.manual_seed(1234)
    cfg = EASConfig(warmup_tokens=0, thresholds=(3.0, 3.0, 3.0), band_edges=(1.0, 2.0), k_max=2)
    for _ in range(n):
        out = model.generate(
            ids,
            max_new_tokens=2,
            do_sample=True,
            temperature=0.7,
            top_k=5,
            assistant_model=draft,
            eas_config=cfg,
            return_dict_in_generate=True,
        )
        key = tuple(out.sequences[0, ids.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        st = out.entmtp_stats["eas"]
        proposed, accepted = proposed + st["verified_draft_tokens"], accepted + st["accepted_draft_tokens"]
    assert 0 < accepted < proposed, "both the accept and the residual-resampling branch should run"
    assert chi_square_p(counts, probs, n) > 1e-3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(eas_config=EASConfig()), "assistant_model"),
        (dict(eas_config="fast", assistant_model=True), "EASConfig"),
        (dict(eas_config=EASConfig(), assistant_model=True, entmtp_config=EntMTPConfig(tree=CHAIN)), "exclusive"),
        (dict(eas_config=EASConfig(), assistant_model=True, prompt_lookup_num_tokens=3), "prompt_lookup"),
    ],
)
def test_bad_eas_calls_raise_before_any_forward(enabled_target, kwargs, message):
    model, draft = enabled_target
    if kwargs.get("assistant_model") is True:
        kwargs["assistant_model"] = draft
    calls = []
    handles = [m.register_forward_pre_hook(lambda *a: calls.append(1)) for m in (model, draft)]
    try:
        with pytest.raises(ValueError, match=message):
            model.generate(prompts(1)[0], max_new_tokens=5, **kwargs)
    finally:
        for h in handles:
            h.remove()
    assert calls == []


def test_plain_assisted_generation_untouched(enabled_target):
    model, draft = enabled_target
    ids = prompts(1)[0]
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and not hasattr(out, "entmtp_stats")
    assert not any("eas" in k for k in vars(model))


# ----------------------------------------------------------------------------- heads
HEAD_EAS = dict(warmup_tokens=6, warmup_length=2, thresholds=(2.0, 1.5, 1.0), band_edges=(1.0, 1.5), window=8)


@pytest.mark.parametrize("tree", [CHAIN, MC_SIM_7B_63], ids=["chain", "mc_sim"])
def test_heads_entropy_policy_greedy_identical(tiny_cache, tree):
    model, heads = tiny_cache()
    enable_entmtp(model, heads)
    depths, halts, proposals = set(), {}, []
    propose = heads.propose
    heads.propose = lambda *a, **k: proposals.append(propose(*a, **k)) or proposals[-1]
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        cfg = EntMTPConfig(tree=tree, eas=EASConfig(**HEAD_EAS))
        out = model.generate(ids, max_new_tokens=40, do_sample=False, entmtp_config=cfg, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        st = out.entmtp_stats
        assert st["tree_indices"] == st["eas"]["chain_lengths"][: len(st["tree_indices"])]
        warm = [n for n, tau in zip(st["eas"]["chain_lengths"], st["eas"]["thresholds"]) if tau is None]
        assert warm and warm == [2] * len(warm) == st["tree_indices"][: len(warm)]  # warm-up: fixed length
        depths.update(st["tree_indices"])
        drafted = [p.depth or 4 for p in proposals[-st["steps"] :]]  # depths the heads computed
        assert all(d <= n + 1 for d, n in zip(drafted, st["eas"]["chain_lengths"]))
        assert drafted[: len(warm)] == [2] * len(warm)  # warm-up chains of 2 draft only 2 depths
        halts = {k: halts.get(k, 0) + v for k, v in st["eas"]["halts"].items()}
    assert len(depths) >= 3 and halts["threshold"] > 0 and halts["k_max"] > 0


def test_heads_entropy_policy_samples_with_exact_acceptance(tiny_cache):
    model, heads = tiny_cache()
    enable_entmtp(model, heads)
    cfg = EntMTPConfig(tree=CHAIN, eas=EASConfig(**HEAD_EAS))
    out = model.generate(
        prompts(1)[0],
        max_new_tokens=20,
        do_sample=True,
        temperature=0.7,
        entmtp_config=cfg,
        return_dict_in_generate=True,
    )
    st = out.entmtp_stats
    assert st["new_tokens"] == 20 and len(st["eas"]["chain_lengths"]) == st["steps"]


def test_heads_entropy_plan_is_the_trees_truncations():
    plan = EntMTPConfig(tree=MC_SIM_7B_63, eas=EASConfig()).resolve(num_heads=4)
    assert [t.depth for t in plan.trees] == [0, 1, 2, 3, 4]
    assert [t.num_nodes for t in plan.trees] == [1, 11, 39, 62, 64]
    assert len(plan.chain_nodes) == 4 and plan.eas == EASConfig()
    assert EntMTPConfig(tree=CHAIN, policy="entropy").resolve(4).eas == EASConfig()  # default settings


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree=CHAIN, eas=EASConfig(), policy="static"), "policy='entropy'"),
        (dict(trees=[CHAIN[:1], CHAIN], policy="entropy"), "one tree"),
        (dict(tree=CHAIN, eas={"k_max": 4}), "EASConfig"),
    ],
)
def test_invalid_entropy_policy(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EntMTPConfig(**kwargs)


# ----------------------------------------------------------------------------- benchmark hook
def test_bench_methods_eas_and_fixed_chains(tmp_path):
    from test_bench import DEFAULTS, tiny_llama, tiny_tokenizer, write_task

    from entmtp_hf.tools.bench.context import BenchContext, random_heads
    from entmtp_hf.tools.bench.runner import run_benchmark
    from entmtp_hf.tools.bench.settings import BenchSettings

    model = tiny_llama()
    ctx = BenchContext(model, tiny_tokenizer(), bank_folder=DEFAULTS, model_name="tiny")
    ctx.heads["hydra"] = random_heads(model, "hydra", seed=0)
    settings = BenchSettings(
        tasks=(write_task(tmp_path, "alpha", 1),),
        num_prompts=1,
        max_new_tokens=8,
        preset="test",
        methods=("vanilla", "eas", "chain-4", "chain-8", "eas-calibrated"),
        warmup_tokens=4,
        perplexity=False,
    )
    results = run_benchmark(ctx, settings)
    assert "depth 8" in results["skipped"]["chain-8"]["alpha"]  # 4 heads: no chain of 8
    assert "--eas-config" in results["skipped"]["eas-calibrated"]["alpha"]  # no settings file given
    recs = {r["method"]: r for r in results["records"]}
    assert set(recs) == {"vanilla", "eas", "chain-4"} and all(r["mismatch"] is None for r in recs.values())
    assert recs["eas"]["eas"]["halts"]["warmup"] > 0 and recs["chain-4"]["eas"] is None
    assert recs["chain-4"]["drafted_tokens"] == 4 * recs["chain-4"]["steps"]
    # the calibrated settings of each task come from --eas-config ({task} replaced)
    (tmp_path / "eas-alpha.json").write_text('{"thresholds": [0.0], "band_edges": [], "warmup_tokens": 0}')
    ctx.eas_config = str(tmp_path / "eas-{task}.json")
    results = run_benchmark(ctx, BenchSettings(**{**settings.__dict__, "methods": ("vanilla", "eas-calibrated")}))
    (rec,) = [r for r in results["records"] if r["method"] == "eas-calibrated"]
    assert rec["mismatch"] is None and rec["eas"]["halts"]["threshold"] == rec["steps"]  # tau 0: every chain halts
    assert results["context"]["eas_config"] == ctx.eas_config


def test_bench_draft_model_methods_int8_draft(tmp_path):
    """The draft-model form in the harness: the target's int8 copy drafts, EAS or a fixed chain
    sets the length, output identical to vanilla."""
    from test_bench import DEFAULTS, tiny_llama, tiny_tokenizer, write_task

    from entmtp_hf.scheduling.eas import fixed_length
    from entmtp_hf.tools.bench.context import BenchContext, quantized_draft, random_heads
    from entmtp_hf.tools.bench.runner import run_benchmark
    from entmtp_hf.tools.bench.settings import BenchSettings

    model = tiny_llama()
    draft = quantized_draft(model)
    assert isinstance(draft.model.layers[0].mlp.up_proj, torch.ao.nn.quantized.dynamic.Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)  # the target is untouched
    ctx = BenchContext(model, tiny_tokenizer(), bank_folder=DEFAULTS, model_name="tiny")
    ctx.heads["hydra"] = random_heads(model, "hydra", seed=0)
    settings = BenchSettings(
        tasks=(write_task(tmp_path, "alpha", 2),),
        num_prompts=2,
        max_new_tokens=12,
        preset="test",
        methods=("vanilla", "draft-eas", "draft-chain-4"),
        warmup_tokens=4,
        perplexity=False,
    )
    results = run_benchmark(ctx, settings)
    recs = [r for r in results["records"] if r["method"] != "vanilla"]
    assert {r["method"] for r in recs} == {"draft-eas", "draft-chain-4"}
    assert all(r["mismatch"] is None for r in recs)  # greedy: identical to vanilla
    chain = [r["eas"] for r in recs if r["method"] == "draft-chain-4"]
    assert all(
        {k for k, n in c["halts"].items() if n} <= {"warmup", "length"} for c in chain
    )  # a fixed chain never halts early
    for r in recs:  # steps are the target's verification forwards (the draft's are not counted)
        assert r["steps"] == r["forwards"] == len(r["eas"]["chain_lengths"])
        assert r["mean_accept_length"] == pytest.approx(r["new_tokens"] / r["steps"])
    assert fixed_length(8).k_max == 8 and fixed_length(8).warmup_length == 8
