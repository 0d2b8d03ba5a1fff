"""Retrieval branches: the n-gram index, the branch added to a tree, and losslessness in generate."""

import pytest
import torch
from test_generation import chi_square_p, enabled, prompts, target_joint

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.drafting.retrieval import NgramIndex
from entmtp_hf.trees.retrieval import RetrievalConfig, with_branch
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree


# ----------------------------------------------------------------------------- the index
def test_longest_recurring_suffix_wins():
    idx = NgramIndex(RetrievalConfig(min_ngram=1, max_ngram=3, num_tokens=3), [1, 2, 3, 9, 9, 3, 4, 2, 3])
    # suffix (2, 3) last followed by 9 at position 3; (3,) alone was last followed by 4
    assert idx.continuation() == [9, 9, 3]
    idx.extend([5])
    assert idx.continuation() == []  # 5 never occurred before
    idx.extend([1])
    assert idx.continuation() == [2, 3, 9]  # (5, 1) unseen; (1,) followed by 2 at the start


def test_most_recent_occurrence_and_cap():
    idx = NgramIndex(RetrievalConfig(min_ngram=2, max_ngram=2, num_tokens=2), [7, 8, 1, 7, 8, 2, 3, 7, 8])
    assert idx.continuation() == [2, 3]  # the later (7, 8) wins over the first one
    short = NgramIndex(RetrievalConfig(min_ngram=1, max_ngram=1, num_tokens=5), [4, 6, 4])
    assert short.continuation() == [6, 4]  # fewer tokens left than num_tokens


def test_index_built_in_one_go_equals_incremental():
    cfg = RetrievalConfig(min_ngram=1, max_ngram=4, num_tokens=4)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 6, (200,), generator=g).tolist()
    inc = NgramIndex(cfg)
    for i in range(0, 200, 7):
        inc.extend(toks[i : i + 7])
        whole = NgramIndex(cfg, toks[: i + 7])
        assert inc.continuation() == whole.continuation() == brute_force(toks[: i + 7], cfg)


def brute_force(toks, cfg):
    for n in range(min(cfg.max_ngram, len(toks)), cfg.min_ngram - 1, -1):
        suffix = toks[len(toks) - n :]
        for start in range(len(toks) - n - 1, -1, -1):  # latest earlier occurrence with a next token
            if toks[start : start + n] == suffix:
                return toks[start + n : start + n + cfg.num_tokens]
    return []


@pytest.mark.parametrize(
    "kw", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(num_tokens=0), dict(mode="swap")]
)
def test_bad_config(kw):
    with pytest.raises(ValueError, match="RetrievalConfig"):
        RetrievalConfig(**kw)
    with pytest.raises(ValueError, match="EntMTPConfig.retrieval: must be"):
        EntMTPConfig(tree=[[0]], retrieval="yes")


# ----------------------------------------------------------------------------- the branch
def test_branch_hangs_from_the_first_free_root_rank():
    tree = Tree.from_choices([[0], [2], [0, 0]])
    out, sources = with_branch(tree, 3)
    assert [3] in out.choices and [3, 0, 0] in out.choices and out.num_nodes == tree.num_nodes + 3
    index = out.node_index()
    for path, i in index.items():
        expected = tree.node_index()[path] if path in tree.node_index() else -len(path)
        assert sources[i] == expected
    root_only, src = with_branch(Tree.root_only(), 2)
    assert root_only.choices == [[0], [0, 0]] and src == [0, -1, -2]


def test_plan_maps_every_branch_node():
    plan = EntMTPConfig(trees=[[[0]], MC_SIM_7B_63], retrieval=RetrievalConfig(num_tokens=3)).resolve(4)
    u = plan.union.num_nodes
    for k, per_length in enumerate(plan.branches):
        for length, (tree, mapping) in enumerate(per_length, start=1):
            assert tree.num_nodes == plan.trees[k].num_nodes + length == len(mapping)
            assert sorted(m for m in mapping if m >= u) == list(range(u, u + length))


def test_bank_default_decides_unless_the_config_says(tmp_path):
    from entmtp_hf.banks.bank import TopologyBank

    trees = [Tree.chain(1), Tree.chain(2)]
    stored = RetrievalConfig(mode="replace", num_tokens=2)
    on = TopologyBank(
        "t", trees, {"scheduler": {"policy": "static", "retrieval": {"mode": "replace", "num_tokens": 2}}}
    )
    off = TopologyBank("t", trees, {"scheduler": {"policy": "static"}})  # banks from before the option: none
    on.save_pretrained(tmp_path)
    assert TopologyBank.from_pretrained(tmp_path, task="t").scheduler.retrieval == stored  # survives the file
    assert "retrieval branches by default: replace, up to 2 tokens" in (tmp_path / "README.md").read_text()
    assert EntMTPConfig(bank=on, task="t").resolve(4).retrieval == stored
    assert EntMTPConfig(bank=on, task="t", policy="hysteresis").resolve(4).branches  # every policy gets them
    assert EntMTPConfig(bank=on, task="t", policy="entropy").resolve(4).retrieval is not None
    assert EntMTPConfig(bank=on, task="t", retrieval=False).resolve(4).retrieval is None  # the caller's word wins
    assert EntMTPConfig(bank=off, task="t").resolve(4).retrieval is None
    mine = RetrievalConfig(num_tokens=2)
    assert EntMTPConfig(bank=off, task="t", retrieval=mine).resolve(4).retrieval == mine
    assert EntMTPConfig(tree=[[0]]).resolve(4).retrieval is None  # no bank: off unless asked for
    for bad, message in (
        ("yes", "JSON object or null"),
        ({"mode": "swap"}, "RetrievalConfig.mode: must be one of"),
        ({"tokens": 2}, "unknown retrieval keys"),
        ({"num_tokens": 1.5}, "must be an integer"),
    ):
        with pytest.raises(ValueError, match=message):
            TopologyBank("t", trees, {"scheduler": {"retrieval": bad}})


def test_replace_mode_verifies_the_chain_alone():
    plan = EntMTPConfig(trees=[[[0]], MC_SIM_7B_63], retrieval=RetrievalConfig(num_tokens=3, mode="replace")).resolve(4)
    u = plan.union.num_nodes
    for per_length in plan.branches:
        for length, (tree, mapping) in enumerate(per_length, start=1):
            assert tree == Tree.chain(length) and mapping == (0, *range(u, u + length))


# ----------------------------------------------------------------------------- generate
def looping_prompt(model, n=24):
    """The tiny model's own greedy text repeats itself, so suffixes recur."""
    ids = prompts(1, seed=5)[0]
    return model.generate(ids, max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("mode", ["append", "replace"])
@pytest.mark.parametrize("tree", [[], [[0]], MC_SIM_7B_63])
def test_greedy_identical_with_retrieval(tiny_cache, tree, mode):
    model = enabled(tiny_cache)
    used = accepted = 0
    for ids in [looping_prompt(model), *prompts(2)]:
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        cfg = EntMTPConfig(tree=tree, retrieval=RetrievalConfig(min_ngram=1, max_ngram=3, num_tokens=4, mode=mode))
        out = model.generate(ids, max_new_tokens=40, do_sample=False, entmtp_config=cfg, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        used += out.entmtp_stats["retrieval_steps"]
        accepted += out.entmtp_stats["retrieval_accepted"]
    assert used > 0 and (accepted > 0 or tree), "the looping text should accept retrieved tokens"


@pytest.mark.parametrize("mode", ["append", "replace"])
def test_greedy_identical_with_retrieval_and_eas(tiny_cache, mode):
    """EAS drafts lazily: an appended branch must only point at nodes the heads did draft."""
    from entmtp_hf.scheduling.eas import EASConfig

    model = enabled(tiny_cache)
    eas = EASConfig(k_max=4, thresholds=(1.0,), band_edges=(), warmup_tokens=0)
    plan = EntMTPConfig(tree=MC_SIM_7B_63, eas=eas, retrieval=RetrievalConfig(mode=mode)).resolve(4)
    depth = [0] + [len(p) for p in plan.union.paths]
    assert len(plan.branches) == len(plan.trees) == 5 and all(plan.branches)
    for k, per_length in enumerate(plan.branches):  # truncation k reads union nodes of depth <= k only
        assert all(depth[m] <= k for m in plan.node_maps[k])
        assert all(depth[m] <= k for _, nodes in per_length for m in nodes if m < plan.union.num_nodes)
    for ids in [looping_prompt(model), *prompts(2)]:
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        cfg = EntMTPConfig(
            tree=MC_SIM_7B_63, eas=eas, retrieval=RetrievalConfig(min_ngram=1, max_ngram=3, num_tokens=4, mode=mode)
        )
        out = model.generate(ids, max_new_tokens=40, do_sample=False, entmtp_config=cfg, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("tree,mode", [([], "append"), ([[0], [1]], "replace")])  # retrieval only; or it and the heads
def test_exact_sampling_with_retrieval_preserves_distribution(tiny_cache, tree, mode):
    model = enabled(tiny_cache)
    ids = looping_prompt(model, 10)
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    cfg = EntMTPConfig(tree=tree, retrieval=RetrievalConfig(min_ngram=1, max_ngram=2, num_tokens=2, mode=mode))
    n, counts, copied = 800, {}, 0
    torch.manual_seed(99)
    for _ in range(n):
        out = model.generate(
            ids,
            max_new_tokens=3,
            do_sample=True,
            temperature=0.7,
            top_k=4,
            entmtp_config=cfg,
            return_dict_in_generate=True,
        )
        key = tuple(out.sequences[0, ids.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        copied += out.entmtp_stats["retrieval_accepted"] > 0
    assert copied > n // 10, "retrieved tokens should often be accepted"
    assert chi_square_p(counts, probs, n) > 1e-3


def test_static_cache_holds_the_longest_branch(tiny_cache):
    model = enabled(tiny_cache)
    ids = looping_prompt(model)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    cfg = EntMTPConfig(tree=MC_SIM_7B_63, retrieval=RetrievalConfig(min_ngram=1, num_tokens=6))
    assert cfg.resolve(4).max_nodes == 64 + 6
    out = model.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="static", entmtp_config=cfg)
    assert torch.equal(out, ref)
