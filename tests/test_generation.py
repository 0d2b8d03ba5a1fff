"""EntMTP inside ``model.generate``: losslessness, HF features, statistics and bad input."""

import dataclasses
import random
from threading import Thread

import pytest
import torch
from tiny import ARCHS, VOCAB
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer, pipeline

from entmtp_hf.banks.bank import TopologyBank, shipped_bank_path
from entmtp_hf.banks.plan import AcceptanceSettings, PlanSpec, build_plan
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.decoding.stats import PhaseTimer
from entmtp_hf.errors import ConfigError
from entmtp_hf.integration import EntMTPGenerationMixin, disable_entmtp, enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
DEFAULTS = str(shipped_bank_path("published-defaults"))


def random_choices(seed: int, size: int = 20, depth: int = 4, rank: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    paths = set()
    while len(paths) < size:
        parent = rng.choice([()] + [p for p in paths if len(p) < depth])
        paths.add(parent + (rng.randrange(rank),))
        for p in list(paths):
            paths.update(p[:k] for k in range(1, len(p)))
    return [list(p) for p in paths]


def prompts(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, 3 + i), generator=g) for i in range(n)]


def enabled(tiny_cache, arch="llama", family="hydra", head_arch="mlp"):
    model, heads = tiny_cache(arch, family, head_arch)
    return enable_entmtp(model, heads)


CONFIGS = {
    "chain": lambda: EntMTPConfig(tree=CHAIN),
    "mc_sim": lambda: EntMTPConfig(tree=MC_SIM_7B_63),
    "random": lambda: EntMTPConfig(tree=random_choices(0)),
    # the tiny models' top-1 probabilities lie around 0.06-0.14: thresholds there use every tree
    "hysteresis": lambda: EntMTPConfig(trees=[CHAIN[:2], MC_SIM_7B_63], tau_on=0.1, tau_off=0.09, feature="base_top1"),
    "ladder": lambda: EntMTPConfig(
        trees=[[[0]], CHAIN, MC_SIM_7B_63], policy="ladder", thresholds=[0.08, 0.1], feature="base_top1"
    ),
    # two 3-node shapes at one cost, and a big tree at a cost that makes it win only on sure steps
    "value": lambda: EntMTPConfig(trees=[[[0], [0, 0]], [[0], [1]], MC_SIM_7B_63], policy="value", costs=[1, 1, 1.9]),
}


# ----------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_to_vanilla(tiny_cache, arch, name):
    model = enabled(tiny_cache, arch)
    longest = 0
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        out = model.generate(
            ids, max_new_tokens=40, do_sample=False, entmtp_config=CONFIGS[name](), return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, ref)
        longest = max(longest, max(out.entmtp_stats["accept_lengths"]))
    assert longest >= (3 if name == "mc_sim" else 2), "the fitted heads should produce long accepted paths"


@pytest.mark.parametrize("seed", range(6))
def test_greedy_random_trees(tiny_cache, seed):
    model = enabled(tiny_cache)
    ids = prompts(1, seed=seed)[0]
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    cfg = EntMTPConfig(tree=random_choices(seed + 1, size=5 + 7 * seed))
    assert torch.equal(model.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=cfg), ref)


@pytest.mark.parametrize("family,head_arch", [("hydra", "prefix-mlp"), ("medusa", "mlp")])
def test_greedy_other_heads(tiny_cache, family, head_arch):
    model = enabled(tiny_cache, "llama", family, head_arch)
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=30, do_sample=False)
        out = model.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert torch.equal(out, ref)


def test_length_limit_inside_accepted_path(tiny_cache):
    model = enabled(tiny_cache)
    ids = prompts(1)[0]
    cut_inside = 0
    for n in range(1, 16):
        ref = model.generate(ids, max_new_tokens=n, do_sample=False)
        out = model.generate(
            ids,
            max_new_tokens=n,
            do_sample=False,
            entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, ref) and out.sequences.shape[1] == ids.shape[1] + n
        st = out.entmtp_stats
        assert st["new_tokens"] == n
        cut_inside += bool(st["tree_sizes"]) and st["accept_lengths"][-1] < 5
    assert cut_inside > 0


@pytest.mark.parametrize("as_list", [False, True])
def test_eos_inside_accepted_path(tiny_cache, as_list):
    model = enabled(tiny_cache)
    checked = 0
    for ids in prompts(3, seed=7):
        full = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :].tolist()
        for k in range(2, 12):  # stop at the first occurrence of a token emitted mid-run
            eos = full[k]
            if eos in full[:k]:
                continue
            eos_arg = [eos, VOCAB + 5] if as_list else eos
            ref = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos_arg)
            out = model.generate(
                ids,
                max_new_tokens=30,
                do_sample=False,
                eos_token_id=eos_arg,
                entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
            )
            assert torch.equal(out, ref) and out[0, -1].item() == eos and out.shape[1] == ids.shape[1] + k + 1
            checked += 1
    assert checked >= 3


def test_static_cache_and_attention_mask(tiny_cache):
    model = enabled(tiny_cache)
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=25, do_sample=False)
        cfg = EntMTPConfig(tree=MC_SIM_7B_63)
        out = model.generate(ids, max_new_tokens=25, do_sample=False, cache_implementation="static", entmtp_config=cfg)
        assert torch.equal(out, ref)
        mask = torch.ones_like(ids)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=25, entmtp_config=cfg), ref)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(repetition_penalty=1.5),
        dict(no_repeat_ngram_size=2),
        dict(min_new_tokens=10, eos_token_id=3),
        dict(bad_words_ids=[[4], [5, 6]]),
        dict(sequence_bias={(5,): 4.0}),
        dict(suppress_tokens=[1, 2]),
        dict(forced_eos_token_id=3, eos_token_id=3),
        dict(max_time=600.0),
    ],
)
def test_logits_processors_see_each_nodes_path(tiny_cache, kwargs):
    model = enabled(tiny_cache)
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=30, do_sample=False, **kwargs)
        out = model.generate(
            ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **kwargs
        )
        assert torch.equal(out, ref)


def test_row_wise_processors_run_once_for_the_whole_tree():
    """Temperature, top-k, top-p, min-p: one batched call gives what the per-node calls give."""
    from transformers.generation.logits_process import (
        LogitsProcessor,
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from entmtp_hf.decoding.processors import process_tree_scores, row_wise

    class Identity(LogitsProcessor):  # not a known row-wise type: forces one call per node
        calls = 0

        def __call__(self, input_ids, scores):
            Identity.calls += 1
            return scores

    buffers = Tree.from_choices(MC_SIM_7B_63).buffers()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(buffers.num_nodes, 500, generator=g) * 4
    tokens = torch.randint(0, 500, (buffers.num_nodes,), generator=g)
    ids = torch.randint(0, 500, (1, 7), generator=g)
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)]
    batched_list, per_depth_list = LogitsProcessorList(warpers), LogitsProcessorList([*warpers, Identity()])
    batched = process_tree_scores(batched_list, ids, tokens, buffers, logits, row_wise=row_wise(batched_list))
    per_depth = process_tree_scores(per_depth_list, ids, tokens, buffers, logits, row_wise=row_wise(per_depth_list))
    assert Identity.calls == buffers.num_nodes
    assert torch.equal(batched, per_depth)
    assert torch.isinf(batched).any() and not torch.equal(batched, logits)


def test_minimum_length_processors_apply_to_the_whole_tree_by_depth():
    """``min_length`` and ``min_new_tokens`` beside row-wise warpers: applied to every node at once,
    each in its place in the list (a top-k before or after them keeps other tokens), exactly what
    one call per node with its own path gives; the minimum falls inside the tree."""
    from transformers.generation.logits_process import (
        LogitsProcessor,
        LogitsProcessorList,
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    from entmtp_hf.decoding.processors import process_tree_scores

    class Identity(LogitsProcessor):  # not a known type: forces one call per node
        def __call__(self, input_ids, scores):
            return scores

    buffers = Tree.from_choices(MC_SIM_7B_63).buffers()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(buffers.num_nodes, 500, generator=g)
    logits[:, [3, 9]] += 6  # EOS among the top-k: the order of top-k and the minimum matters
    tokens = torch.randint(0, 500, (buffers.num_nodes,), generator=g)
    ids = torch.randint(0, 500, (1, 7), generator=g)
    depths = set(buffers.position_ids.tolist())
    assert {0, 1, 2, 3} <= depths  # new tokens 2 + depth, text 7 + depth: both minimums inside the tree
    for processors in (
        [TopKLogitsWarper(5), MinNewTokensLengthLogitsProcessor(5, 4, [3, 9]), TemperatureLogitsWarper(0.7)],
        [MinLengthLogitsProcessor(10, 3), TopKLogitsWarper(5)],
    ):
        fast = process_tree_scores(LogitsProcessorList(processors), ids, tokens, buffers, logits, row_wise=False)
        slow = LogitsProcessorList([*processors, Identity()])
        assert torch.equal(fast, process_tree_scores(slow, ids, tokens, buffers, logits, row_wise=False))
        short, long = buffers.position_ids == 0, buffers.position_ids == max(depths)
        assert torch.isinf(fast[short][:, 3]).all() and not torch.isinf(fast[long][:, 3]).any()


# ----------------------------------------------------------------------------- sampling
def target_joint(model, ids, temperature, top_k, length=3):
    """Exact probabilities of every continuation of ``length`` tokens under the warped model."""

    def warped(seqs):
        with torch.no_grad():
            logits = model(seqs).logits[:, -1].float() / temperature
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
        return torch.softmax(logits.double(), -1)

    dist = {(): 1.0}
    for _ in range(length):
        keys = list(dist)
        seqs = torch.stack([torch.cat([ids[0], torch.tensor(k, dtype=torch.long)]) for k in keys])
        probs = warped(seqs)
        dist = {
            k + (t,): dist[k] * probs[i, t].item() for i, k in enumerate(keys) for t in range(VOCAB) if probs[i, t] > 0
        }
    return dist


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """p-value of Pearson's chi-square test, cells with expectation < 5 pooled."""
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for key, p in probs.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    dof = torch.tensor((cells - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))  # chi2 survival


SAMPLING_TREE = [[0], [1], [2], [3], [0, 0], [1, 0], [0, 1], [0, 0, 0]]


def sample_counts(model, ids, n, **kwargs):
    counts, long_paths = {}, 0
    torch.manual_seed(1234)
    for _ in range(n):
        out = model.generate(
            ids, max_new_tokens=3, do_sample=True, temperature=0.7, top_k=4, return_dict_in_generate=True, **kwargs
        )
        key = tuple(out.sequences[0, ids.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        stats = getattr(out, "entmtp_stats", None)
        long_paths += bool(stats) and max(stats["accept_lengths"], default=0) >= 2
    return counts, long_paths


@pytest.mark.parametrize("name,trees", [("hysteresis", {0, 1}), ("ladder", {0, 1, 2})])
def test_feature_policies_use_every_tree(tiny_cache, name, trees):
    """Else the greedy test above would check one tree, not the switching."""
    model = enabled(tiny_cache)
    used = set()
    for ids in prompts():
        out = model.generate(
            ids, max_new_tokens=40, do_sample=False, entmtp_config=CONFIGS[name](), return_dict_in_generate=True
        )
        used.update(out.entmtp_stats["tree_indices"])
    assert used == trees


def test_value_policy_switches_between_same_size_shapes(tiny_cache):
    """The value policy must actually use each tree, or the greedy test above proves little."""
    model = enabled(tiny_cache)
    used = set()
    for ids in prompts():
        out = model.generate(
            ids, max_new_tokens=40, do_sample=False, entmtp_config=CONFIGS["value"](), return_dict_in_generate=True
        )
        used.update(out.entmtp_stats["tree_indices"])
    assert used == {0, 1, 2}


@pytest.mark.parametrize(
    "feature,drafts_union", [("base_top1", False), ("accept_ema", False), ("head_confidence", True)]
)
def test_a_feature_known_before_drafting_drafts_the_chosen_tree_only(tiny_cache, monkeypatch, feature, drafts_union):
    model = enabled(tiny_cache)
    heads, drafted = model.entmtp_heads, []
    real = heads.propose
    monkeypatch.setattr(heads, "propose", lambda s, r, b, **k: drafted.append(b.num_nodes) or real(s, r, b, **k))
    trees = [[[0]], MC_SIM_7B_63]  # T-: one drafted node; T+: 63
    thresholds = {"accept_ema": (1.5, 1.5), "head_confidence": (0.2, 0.2)}.get(feature, (0.1, 0.1))
    config = EntMTPConfig(trees=trees, tau_on=thresholds[0], tau_off=thresholds[1], feature=feature)
    used = set()
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=30, do_sample=False)
        drafted.clear()
        out = model.generate(
            ids, max_new_tokens=30, do_sample=False, entmtp_config=config, return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, ref)
        sizes = [Tree.from_choices(trees[k]).num_nodes for k in out.entmtp_stats["tree_indices"]]
        assert drafted == ([64] * len(sizes) if drafts_union else sizes)
        used.update(sizes)
    assert used == {2, 64}, "both trees should be used for the test to mean anything"


@pytest.mark.parametrize("feature,reads", [("base_top1", True), ("accept_ema", False), ("head_confidence", False)])
def test_the_verifiers_softmax_runs_only_for_a_feature_that_reads_it(tiny_cache, monkeypatch, feature, reads):
    import entmtp_hf.drafting.drafter as drafter

    model, calls = enabled(tiny_cache), []
    real = drafter.top1_and_entropy
    monkeypatch.setattr(drafter, "top1_and_entropy", lambda logits: calls.append(1) or real(logits))
    config = EntMTPConfig(trees=[[[0]], CHAIN[:3]], tau_on=0.3, tau_off=0.3, feature=feature)
    for ids in prompts(2):
        calls.clear()
        ref = model.generate(ids, max_new_tokens=20, do_sample=False)
        out = model.generate(
            ids, max_new_tokens=20, do_sample=False, entmtp_config=config, return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, ref)
        # one after the prefill and one after every step
        assert len(calls) == (len(out.entmtp_stats["accept_lengths"]) + 1 if reads else 0)


def test_value_policy_reads_head_probabilities_at_the_sampling_temperature(tiny_cache, monkeypatch):
    model = enabled(tiny_cache)
    heads, seen = model.entmtp_heads, []
    real = heads.propose
    monkeypatch.setattr(heads, "propose", lambda *a, **k: seen.append(k.get("temperature", 1.0)) or real(*a, **k))
    ids = prompts(1)[0]
    for config, kwargs, want in [
        (CONFIGS["value"](), dict(do_sample=True, temperature=0.7), {0.7}),
        (CONFIGS["value"](), dict(do_sample=False), {1.0}),
        (EntMTPConfig(tree=MC_SIM_7B_63), dict(do_sample=True, temperature=0.7), {1.0}),  # no value estimate
    ]:
        seen.clear()
        model.generate(ids, max_new_tokens=6, entmtp_config=config, **kwargs)
        assert set(seen) == want


SCHEDULED_SAMPLING = {
    "value": lambda: EntMTPConfig(trees=[[[0], [0, 0]], [[0], [1]], SAMPLING_TREE], policy="value", costs=[1, 1, 2]),
    # a feature known before drafting: only the chosen tree is drafted
    "pre-draft hysteresis": lambda: EntMTPConfig(
        trees=[[[0]], SAMPLING_TREE], tau_on=0.1, tau_off=0.1, feature="base_top1"
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULED_SAMPLING))
def test_exact_sampling_preserves_distribution_under_schedulers(tiny_cache, name):
    model = enabled(tiny_cache)
    ids = prompts(1, seed=3)[0]
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    n = 1000
    counts, long_paths = sample_counts(model, ids, n, entmtp_config=SCHEDULED_SAMPLING[name]())
    assert long_paths > n // 6  # enough multi-token steps for the test to have power (~200 of 1000)
    assert chi_square_p(counts, probs, n) > 1e-3


def test_exact_sampling_preserves_distribution(tiny_cache):
    model = enabled(tiny_cache)
    ids = prompts(1, seed=3)[0]
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    n = 1000
    counts, long_paths = sample_counts(model, ids, n, entmtp_config=EntMTPConfig(tree=SAMPLING_TREE))
    assert long_paths > n // 4, "drafted tokens should often be accepted"
    assert chi_square_p(counts, probs, n) > 1e-3
    # control: typical acceptance is not distribution-preserving, and the same test sees it
    biased, _ = sample_counts(
        model, ids, n, entmtp_config=EntMTPConfig(tree=SAMPLING_TREE, acceptance="typical", posterior_threshold=0.3)
    )
    assert chi_square_p(biased, probs, n) < 1e-3


# ----------------------------------------------------------------------------- HF features
def word_tokenizer():
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def test_streamer_receives_exactly_the_generated_text(tiny_cache):
    model = enabled(tiny_cache)
    tokenizer = word_tokenizer()
    ids = prompts(1)[0]
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    kwargs = dict(max_new_tokens=30, do_sample=False, streamer=streamer, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    result = {}
    thread = Thread(target=lambda: result.setdefault("out", model.generate(ids, **kwargs)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text.strip() == tokenizer.decode(result["out"][0, ids.shape[1] :]).strip()
    assert len(text.split()) == 30


def test_return_dict_statistics(tiny_cache):
    model = enabled(tiny_cache)
    ids = prompts(1)[0]
    cfg = EntMTPConfig(trees=[CHAIN[:2], MC_SIM_7B_63], tau_on=0.6, tau_off=0.4, feature="base_top1")
    timer = PhaseTimer()
    out = model.generate(
        ids,
        max_new_tokens=30,
        do_sample=False,
        entmtp_config=cfg,
        return_dict_in_generate=True,
        entmtp_observers=[timer],
    )
    st = out.entmtp_stats
    steps = st["steps"]
    assert steps == len(st["accept_lengths"]) == len(st["tree_indices"]) == len(st["features"]) > 0
    assert 1 + sum(st["accept_lengths"]) == out.sequences.shape[1] - ids.shape[1] == st["new_tokens"]
    assert st["mean_accept_length"] == pytest.approx(sum(st["accept_lengths"]) / steps)
    assert set(st["tree_indices"]) <= {0, 1} and timer.steps == steps and all(t > 0 for t in timer.seconds.values())
    assert 0 < st["prefill_time"] < st["total_time"]
    assert all(0 < f <= 1 for f in st["features"])


def test_pipeline_passes_entmtp_config(tiny_cache):
    model = enabled(tiny_cache)
    tokenizer = word_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = "w1 w5 w7 w2"
    ref = pipe(text, max_new_tokens=20, do_sample=False)[0]["generated_text"]
    out = pipe(text, max_new_tokens=20, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))[0]
    assert out["generated_text"] == ref and len(ref) > len(text) + 20


def test_enable_twice_and_disable(tiny_cache):
    model, heads = tiny_cache()
    ids = prompts(1)[0]
    enable_entmtp(model, heads)
    cls = type(model)
    enable_entmtp(model, heads)
    assert type(model) is cls and isinstance(model, EntMTPGenerationMixin)
    assert model.entmtp_heads is heads
    with_heads = model.generate(ids, max_new_tokens=10, do_sample=False)
    disable_entmtp(model)
    assert not isinstance(model, EntMTPGenerationMixin) and not hasattr(model, "entmtp_heads")
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), with_heads)
    enable_entmtp(model, heads)


# ----------------------------------------------------------------------------- bad input
@pytest.fixture
def forward_counter(tiny_cache):
    model = enabled(tiny_cache)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield model, calls
    handle.remove()


@pytest.mark.parametrize(
    "make_kwargs, message",
    [
        (lambda ids: dict(num_beams=2), "num_beams"),
        (lambda ids: dict(num_return_sequences=2), "num_return_sequences"),  # greedy: refused as plain generate does
        (lambda ids: dict(entmtp_config=EntMTPConfig(tree=CHAIN + [[0, 0, 0, 0, 0]])), "depth 5"),
        (lambda ids: dict(entmtp_config=EntMTPConfig(tree=CHAIN, acceptance="typical")), "do_sample=True"),
        (lambda ids: dict(entmtp_config=EntMTPConfig(bank=DEFAULTS, task="nope")), "nope"),
        (lambda ids: dict(entmtp_config="static"), "EntMTPConfig"),
        (lambda ids: dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    ],
)
def test_bad_input_raises_before_any_forward(forward_counter, make_kwargs, message):
    model, calls = forward_counter
    ids = prompts(1)[0]
    kwargs = {"inputs": ids, "max_new_tokens": 5, "entmtp_config": EntMTPConfig(tree=CHAIN)}
    kwargs.update(make_kwargs(ids))
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs)
    assert calls == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree=CHAIN, policy="bogus"), "EntMTPConfig.policy: must be one of"),
        (dict(trees=[CHAIN[:1], CHAIN], tau_on=0.1, tau_off=0.2), "tau_off"),
        (dict(trees=[[[0]], CHAIN[:2], CHAIN], policy="ladder", thresholds=[0.5, 0.1]), "strictly increasing"),
        (dict(tree=[[0], [1, 1]]), "missing"),
        (dict(bank=DEFAULTS), "task="),
        (dict(tree=CHAIN, acceptance="fast"), "EntMTPConfig.acceptance: must be one of"),
        (dict(), "exactly one of"),
        (dict(tree=CHAIN, policy="ladder"), "several trees"),
        (dict(tree=CHAIN, policy="value"), "several trees"),
        (dict(trees=[CHAIN, CHAIN[:1]], policy="value", costs=[1.0]), "one positive forward cost"),
        (dict(trees=[CHAIN, CHAIN[:1]], policy="value", costs=[1.0, 0.0]), r"EntMTPConfig.costs\[1\]: 0.0 is outside"),
    ],
)
def test_invalid_config(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EntMTPConfig(**kwargs)


def test_bank_config_resolves_scheduler_defaults():
    bank = TopologyBank.from_pretrained(DEFAULTS, task="default")
    plan = EntMTPConfig(bank=bank, task="default").resolve(num_heads=4)
    low, high = plan.trees
    assert low.num_nodes < high.num_nodes and plan.scheduler_args["policy"] == "hysteresis"
    plan = EntMTPConfig(bank=bank, task="default", policy="static").resolve(num_heads=4)
    assert plan.trees == (bank.trees[bank.scheduler.static],)
    assert Tree.from_choices(MC_SIM_7B_63) in bank.trees


def test_bank_default_policy_and_feature_are_used_unless_overridden():
    trees = [Tree.root_only(), Tree.chain(2), Tree.from_choices(MC_SIM_7B_63)]
    sched = {
        "static": 1,
        "conservative": 1,
        "aggressive": 2,
        "tau_on": 0.6,
        "tau_off": 0.6,
        "policy": "static",
        "feature": "chain_value",
        "ladder_feature": "base_top1",
    }
    bank = TopologyBank("t", trees, {"scheduler": sched})
    plan = EntMTPConfig(bank=bank, task="t").resolve(num_heads=4)
    assert plan.trees == (trees[1],) and plan.scheduler_args["policy"] == "static"
    plan = EntMTPConfig(bank=bank, task="t", policy="hysteresis").resolve(num_heads=4)
    assert plan.trees == (trees[1], trees[2]) and plan.scheduler_args["tau_on"] == 0.6
    assert plan.feature == "chain_value"
    plan = EntMTPConfig(bank=bank, task="t", policy="ladder").resolve(num_heads=4)
    assert plan.feature == "base_top1"
    plan = EntMTPConfig(bank=bank, task="t", policy="hysteresis", feature="confidence").resolve(num_heads=4)
    assert plan.feature == "confidence"
    with pytest.raises(ValueError, match="lists no trees for the value policy"):
        EntMTPConfig(bank=bank, task="t", policy="value").resolve(num_heads=4)
    sched = {**sched, "value": [1, 2], "value_costs": [1.0, 1.4]}
    bank = TopologyBank("t", trees, {"scheduler": sched})
    plan = EntMTPConfig(bank=bank, task="t", policy="value").resolve(num_heads=4)
    assert plan.trees == (trees[1], trees[2]) and plan.scheduler_args == {"policy": "value", "costs": (1.0, 1.4)}


# ----------------------------------------------------------------------------- the drafter's contract
@pytest.mark.parametrize("batch", [1, 3])
def test_the_step_verifies_what_draft_returns_and_the_drafter_learns_what_it_accepted(tiny_cache, monkeypatch, batch):
    """The step verifies exactly what ``TreeDrafter.draft`` returned (a drafter returning the root
    alone instead of what it drafted is verified as returned), and ``learn`` gets, per row, that
    draft and the length of the path the step accepted of it."""
    from entmtp_hf.drafting.drafter import Draft, TreeDrafter

    model, heads = tiny_cache("llama", "hydra", "mlp")
    enable_entmtp(model, heads)
    real = TreeDrafter.draft
    returned, learnt = [], []

    def root_only(self, rows, texts):
        drafts = real(self, rows, texts)
        assert len(drafts) == len(rows) == len(texts)
        assert all(torch.equal(d.tokens[:1], t[0, -1:]) for d, t in zip(drafts, texts))  # node 0 is the root
        roots = [Draft(0, d.tokens[:1], Tree.root_only().buffers(d.tokens.device, model.dtype), None) for d in drafts]
        returned.append(roots)
        return roots

    def learn(self, rows, drafts, accepted):
        learnt.append((list(drafts), list(accepted)))

    monkeypatch.setattr(TreeDrafter, "draft", root_only)
    monkeypatch.setattr(TreeDrafter, "learn", learn)
    ids = torch.randint(1, VOCAB, (batch, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, model.generate(ids, **kwargs))
    assert out.entmtp_stats["tree_sizes"] == [1] * len(returned) * batch
    assert out.entmtp_stats["accept_lengths"] == [1] * len(returned) * batch
    assert len(learnt) == len(returned) == out.entmtp_stats["steps"] == 9
    for drafts, (got, accepted) in zip(returned, learnt):
        assert all(a is b for a, b in zip(drafts, got)) and accepted == [1] * batch


def test_plan_spec_read_once_and_the_plan_carries_the_call_settings():
    """The config is read once into a frozen, typed PlanSpec (its bank loaded there); the plan
    built from the spec alone carries what decoding reads, so no config travels below it."""
    cfg = EntMTPConfig(tree=CHAIN, acceptance="typical", posterior_threshold=0.2, posterior_alpha=0.5, feature_window=4)
    spec = cfg.plan_spec()
    assert isinstance(spec, PlanSpec) and cfg.plan_spec() is spec and spec.tree == Tree.from_choices(CHAIN)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.policy = "static"
    plan = cfg.resolve(4)
    assert plan.acceptance == AcceptanceSettings("typical", 0.2, 0.5, "project") and plan.feature_window == 4
    assert build_plan(spec, 4) == plan
    bank = TopologyBank.from_pretrained(DEFAULTS, task="default")
    assert EntMTPConfig(bank=bank, task="default").plan_spec().bank is bank
