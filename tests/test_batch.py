"""Batches: every row of a left-padded batch decodes exactly as its prompt would alone."""

import dataclasses

import pytest
import torch
from test_generation import CONFIGS, SAMPLING_TREE, chi_square_p, target_joint
from tiny import VOCAB
from transformers.generation.streamers import BaseStreamer

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.decoding.attention import tree_inputs
from entmtp_hf.decoding.cache import accepted_slots, additive_mask, keep_accepted
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

PAD = 0
LENGTHS = (3, 6, 4, 9)


def enabled(tiny_cache, arch="llama"):
    model, heads = tiny_cache(arch, "hydra", "mlp")
    return enable_entmtp(model, heads)


def generate(model, ids, **kwargs):
    """``model.generate`` with the batch's pad id (the shared tiny models have none set)."""
    return model.generate(ids, pad_token_id=PAD, **kwargs)


def batch_of(lengths=LENGTHS, seed=5):
    """Prompts of different lengths (no pad token inside) and their left-padded batch."""
    g = torch.Generator().manual_seed(seed)
    singles = [torch.randint(1, VOCAB, (1, n), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(singles):
        ids[i, width - p.shape[1] :], mask[i, width - p.shape[1] :] = p[0], 1
    return singles, ids, mask


def eos_ending_rows_apart(model, singles, new_tokens):
    """Two EOS ids that end the prompts' greedy continuations at different steps."""
    conts = [generate(model, p, max_new_tokens=new_tokens, do_sample=False)[0, p.shape[1] :].tolist() for p in singles]
    seen = [t for t in conts[0][4:] if t != PAD]
    for a in seen:
        for b in seen:
            if a != b:
                ends = [next((i for i, t in enumerate(c) if t in (a, b)), len(c)) for c in conts]
                if len(set(ends)) >= 3:
                    return [a, b]
    raise AssertionError("no EOS pair ends the rows apart")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_equals_its_prompt_alone(tiny_cache, arch, name):
    model = enabled(tiny_cache, arch)
    singles, ids, mask = batch_of()
    eos = eos_ending_rows_apart(model, singles, 30)
    config = CONFIGS[name]()
    out = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        entmtp_config=config,
        return_dict_in_generate=True,
    )
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(out.sequences, plain)
    generated = []
    for i, p in enumerate(singles):
        alone = generate(model, p, max_new_tokens=30, do_sample=False, eos_token_id=eos)[0, p.shape[1] :]
        row = out.sequences[i, ids.shape[1] :]
        assert torch.equal(row[: alone.shape[0]], alone)
        assert bool((row[alone.shape[0] :] == PAD).all())
        generated.append(out.entmtp_stats["rows"][i]["new_tokens"])
        assert generated[-1] == alone.shape[0]
    assert len(set(generated)) >= 3, "rows should end on EOS at different steps"
    assert max(max(r["accept_lengths"], default=0) for r in out.entmtp_stats["rows"]) >= 2


@pytest.mark.parametrize("arch", ["eagle", "eagle3"])
def test_every_row_equals_its_prompt_alone_with_an_eagle_drafter(tiny_cache, arch):
    """The drafter drafts a batch's rows together (its caches left-padded): still every row as alone."""
    from test_generation import random_choices

    model, heads = tiny_cache("llama", "eagle", arch)
    model = enable_entmtp(model, heads)
    singles, ids, mask = batch_of(seed=9)
    eos = eos_ending_rows_apart(model, singles, 30)
    for tree in (MC_SIM_7B_63, random_choices(1)):
        out = generate(
            model,
            ids,
            attention_mask=mask,
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=eos,
            entmtp_config=EntMTPConfig(tree=tree),
            return_dict_in_generate=True,
        )
        for i, p in enumerate(singles):
            alone = generate(model, p, max_new_tokens=30, do_sample=False, eos_token_id=eos)[0, p.shape[1] :]
            row = out.sequences[i, ids.shape[1] :]
            assert torch.equal(row[: alone.shape[0]], alone) and bool((row[alone.shape[0] :] == PAD).all())
        assert max(max(r["accept_lengths"], default=0) for r in out.entmtp_stats["rows"]) >= 2


def test_random_trees_in_a_batch(tiny_cache):
    from test_generation import random_choices

    model = enabled(tiny_cache)
    singles, ids, mask = batch_of(seed=7)
    for seed in range(3):
        config = EntMTPConfig(tree=random_choices(seed))
        out = generate(model, ids, attention_mask=mask, max_new_tokens=25, do_sample=False, entmtp_config=config)
        assert torch.equal(out, generate(model, ids, attention_mask=mask, max_new_tokens=25, do_sample=False))


def test_finished_rows_leave_the_forward(tiny_cache):
    model = enabled(tiny_cache)
    singles, ids, mask = batch_of()
    eos = eos_ending_rows_apart(model, singles, 30)
    sizes = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        out = generate(
            model,
            ids,
            attention_mask=mask,
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=eos,
            entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
            return_dict_in_generate=True,
        )
    finally:
        handle.remove()
    live = out.entmtp_stats["live_batch_sizes"]
    assert sizes[1:] == live  # the prefill, then one forward per step over the live rows only
    assert live == sorted(live, reverse=True) and live[-1] < len(LENGTHS)


def test_a_new_live_batch_size_switches_the_plan(tiny_cache, monkeypatch):
    """``plan_for``: each live batch size verifies its own trees; rows keep their heads' state."""
    from entmtp_hf import integration

    model = enabled(tiny_cache)
    singles, ids, mask = batch_of()
    eos = eos_ending_rows_apart(model, singles, 30)
    big, small = EntMTPConfig(tree=MC_SIM_7B_63), EntMTPConfig(tree=[[0]])
    heads = model.entmtp_heads
    plans = {b: (big if b >= 3 else small).resolve(heads.num_heads, heads.config.draft_vocab_rows) for b in range(1, 5)}
    real = integration.entmtp_decode
    monkeypatch.setattr(integration, "entmtp_decode", lambda *a, **k: real(*a, **{**k, "plan_for": plans.__getitem__}))
    out = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        entmtp_config=big,
        return_dict_in_generate=True,
    )
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(out.sequences, plain)
    sizes = out.entmtp_stats["live_batch_sizes"]
    assert min(sizes) < 3 <= max(sizes)
    longest = max(out.entmtp_stats["rows"], key=lambda r: r["steps"])["tree_sizes"]
    assert {n for n, b in zip(longest, sizes) if b >= 3} == {Tree.from_choices(MC_SIM_7B_63).num_nodes}
    assert {n for n, b in zip(longest, sizes) if b < 3} == {2}


def test_batch_statistics_hold_every_rows_and_the_calls(tiny_cache, monkeypatch):
    """Each row's statistics, EAS's included, run over all of its steps (across a change of plan);
    the top level holds the call's: every row's steps together, the call's steps and live sizes."""
    from entmtp_hf import integration
    from entmtp_hf.scheduling.eas import EASConfig

    model = enabled(tiny_cache)
    singles, ids, mask = batch_of()
    eos = eos_ending_rows_apart(model, singles, 30)
    eas = EASConfig(warmup_tokens=4, warmup_length=2, thresholds=(2.0, 1.5, 1.0), band_edges=(1.0, 1.5))
    big, small = EntMTPConfig(tree=MC_SIM_7B_63, eas=eas), EntMTPConfig(tree=[[0], [0, 0]], eas=eas)
    heads = model.entmtp_heads
    plans = {b: (big if b >= 3 else small).resolve(heads.num_heads, heads.config.draft_vocab_rows) for b in range(1, 5)}
    real = integration.entmtp_decode
    monkeypatch.setattr(integration, "entmtp_decode", lambda *a, **k: real(*a, **{**k, "plan_for": plans.__getitem__}))
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    out = generate(model, ids, entmtp_config=big, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, generate(model, ids, **kwargs))
    st, rows = out.entmtp_stats, out.entmtp_stats["rows"]
    assert min(st["live_batch_sizes"]) < 3 <= max(st["live_batch_sizes"])
    for row in rows:
        assert len(row["eas"]["chain_lengths"]) == row["steps"] == sum(row["eas"]["halts"].values()) > 0
    assert st["steps"] == len(st["live_batch_sizes"]) == max(r["steps"] for r in rows)
    assert sum(st["live_batch_sizes"]) == sum(r["steps"] for r in rows) == len(st["accept_lengths"])
    for key in ("accept_lengths", "tree_indices", "tree_sizes", "features"):
        assert st[key] == [x for r in rows for x in r[key]]
    for key in ("new_tokens", "drafted_tokens", "accepted_draft_tokens", "retrieval_steps", "root_alone_steps"):
        assert st[key] == sum(r[key] for r in rows)
    assert st["mean_accept_length"] == pytest.approx(sum(st["accept_lengths"]) / len(st["accept_lengths"]))
    assert st["eas"]["chain_lengths"] == [n for r in rows for n in r["eas"]["chain_lengths"]]
    assert st["eas"]["halts"] == {k: sum(r["eas"]["halts"][k] for r in rows) for k in st["eas"]["halts"]}
    verified = sum(r["eas"]["verified_draft_tokens"] for r in rows)
    rejected = verified - sum(r["eas"]["accepted_draft_tokens"] for r in rows)
    assert st["eas"]["rejected_fraction"] == pytest.approx(rejected / verified)


def test_tree_inputs_pad_each_row_to_the_largest_tree():
    chain, fan = Tree.chain(2), Tree.from_choices([[0], [1], [2], [3]])
    drafts = []
    for tree in (chain, fan):
        b = tree.buffers(torch.device("cpu"), torch.float64)
        drafts.append(type("D", (), {"buffers": b, "tokens": torch.arange(1, b.num_nodes + 1)})())
    prefix = torch.zeros(2, 4, dtype=torch.float64)
    prefix[0, 0] = torch.finfo(torch.float64).min  # a padded slot
    tokens, positions, mask = tree_inputs(drafts, [10, 20], prefix, prefix.shape[1] + 5)
    assert tokens.tolist() == [[1, 2, 3, 1, 1], [1, 2, 3, 4, 5]]
    assert positions.tolist() == [[10, 11, 12, 10, 10], [20, 21, 21, 21, 21]]
    visible = mask[:, 0] == 0
    assert visible[0, :, 0].sum() == 0 and visible[1, :, 0].all()  # row 0's padding stays masked
    assert visible[0, 3].tolist() == [
        False,
        True,
        True,
        True,
        False,
        False,
        False,
        True,
        False,
    ]  # a pad node: prefix + itself
    assert visible[1, 2, 4:].tolist() == [True, False, True, False, False]  # fan node 2: root and itself


def test_keep_accepted_masks_the_slots_a_row_did_not_fill():
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.arange(2 * 7, dtype=torch.float64).reshape(2, 1, 7, 1)
    cache.update(keys.clone(), keys.clone() + 100, 0)
    slots = torch.tensor([[0, 1, 2], [-1, 0, 1]])  # row 1 is left-padded
    keep_accepted(cache, 3, [[0, 2, 3], [0]])
    new = accepted_slots(slots, 3, [3, 2], [3, 1])
    assert cache.get_seq_length() == 6
    assert cache.layers[0].keys[0, 0, 3:, 0].tolist() == [3, 5, 6]
    assert cache.layers[0].keys[1, 0, 3, 0].item() == 10
    assert new.tolist() == [[0, 1, 2, 3, 4, 5], [-1, 0, 1, 2, -1, -1]]
    mask = additive_mask(new, torch.float64)
    assert (mask[0] == 0).all() and mask[1, 0] < -1e300 and (mask[1, 1:4] == 0).all() and (mask[1, 4:] < -1e300).all()


# ----------------------------------------------------------------------------- sampling
def test_exact_sampling_in_a_batch_preserves_every_rows_distribution(tiny_cache):
    model = enabled(tiny_cache)
    singles, ids, mask = batch_of(lengths=(3, 5), seed=3)
    targets = [target_joint(model, p, temperature=0.7, top_k=4) for p in singles]
    n = 800

    def counts(config):
        torch.manual_seed(99)
        per_row = [{}, {}]
        for _ in range(n):
            out = generate(
                model,
                ids,
                attention_mask=mask,
                max_new_tokens=3,
                do_sample=True,
                temperature=0.7,
                top_k=4,
                entmtp_config=config,
            )
            for i in range(2):
                key = tuple(out[i, ids.shape[1] :].tolist())
                per_row[i][key] = per_row[i].get(key, 0) + 1
        return per_row

    exact = counts(EntMTPConfig(tree=SAMPLING_TREE))
    for i in range(2):
        assert chi_square_p(exact[i], targets[i], n) > 1e-3
    # control: typical acceptance is not distribution-preserving, and the same test sees it in a batch
    typical = counts(EntMTPConfig(tree=SAMPLING_TREE, acceptance="typical", posterior_threshold=0.3))
    assert min(chi_square_p(typical[i], targets[i], n) for i in range(2)) < 1e-3


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "make_kwargs, message",
    [
        (lambda ids, mask: dict(attention_mask=mask.flip(-1)), "left-padded"),
        (lambda ids, mask: dict(num_beams=2), "num_beams"),
    ],
)
def test_bad_batch_input_raises_before_any_forward(tiny_cache, make_kwargs, message):
    model = enabled(tiny_cache)
    _, ids, mask = batch_of()
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        kwargs = dict(attention_mask=mask, max_new_tokens=5, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        kwargs.update(make_kwargs(ids, mask))
        with pytest.raises(ValueError, match=message):
            generate(model, ids, **kwargs)
    finally:
        handle.remove()
    assert calls == []


# ----------------------------------------------------------------------------- trees by batch size
def test_cost_tables_by_batch_size():
    from entmtp_hf.calibration import batch_bucket
    from entmtp_hf.costs.table import CostTable

    one = CostTable({"key": "m"}, "x", {1: 10.0, 4: 14.0}, (1.0, 0.5, 0.1), (2.0, 0.25), 12.0)
    four = dataclasses.replace(one, forward_ms={1: 12.0, 4: 30.0}, plain_ms=13.0, batch_size=4)
    tree = Tree.chain(3)  # 4 nodes, depth 3
    per_row = one.drafting(tree) + 2.0 + 0.25 * 4
    assert one.step(tree) == pytest.approx(14.0 + per_row)
    assert four.step(tree) == pytest.approx(30.0 + 4 * per_row)  # drafting and overhead per row
    assert four.key == one.key + "-b4" and CostTable.from_dict(four.to_dict()) == four
    with pytest.raises(ValueError, match="batch_size"):
        CostTable.from_dict({**four.to_dict(), "batch_size": 0})
    assert [batch_bucket(b) for b in range(1, 10)] == [1, 2, 2, 4, 4, 4, 4, 8, 8]


def test_a_bank_verifies_the_trees_ranked_for_the_live_batch_size(tiny_cache):
    from test_costs import _with_machine_costs, frontier_bank

    model = enabled(tiny_cache)
    heads = model.entmtp_heads
    singles, ids, mask = batch_of()
    eos = eos_ending_rows_apart(model, singles, 30)
    bank = frontier_bank()  # chains of 1..4 nodes, tau 1.0 / 1.6 / 2.0 / 2.2
    for b, forward in {
        1: {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0},  # 4 nodes pay at one row,
        2: {1: 10.0, 2: 10.0, 3: 10.5, 4: 20.0},  # 3 at two,
        4: {1: 10.0, 2: 10.5, 3: 20.0, 4: 30.0},
    }.items():  # 2 at four
        bank = bank.with_machine(dataclasses.replace(_with_machine_costs(model, heads, forward), batch_size=b))
    out = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        entmtp_config=EntMTPConfig(bank=bank, task="t"),
        return_dict_in_generate=True,
    )
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(out.sequences, plain)
    sizes = out.entmtp_stats["live_batch_sizes"]
    longest = max(out.entmtp_stats["rows"], key=lambda r: r["steps"])["tree_sizes"]
    want = {4: 2, 3: 3, 2: 3, 1: 4}
    assert [want[b] for b in sizes] == longest[: len(sizes)] and len(set(sizes)) >= 2
    # where nothing beats plain decoding at the call's batch size, the call is plain batched generate
    slow = bank.with_machine(
        dataclasses.replace(_with_machine_costs(model, heads, {1: 10.0, 2: 30.0, 4: 60.0}), batch_size=4)
    )
    root_only = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        entmtp_config=EntMTPConfig(bank=slow, task="t"),
        return_dict_in_generate=True,
    )
    assert torch.equal(root_only.sequences, plain) and root_only.entmtp_stats["plain_decoding"]


@pytest.mark.parametrize(
    "family,head_arch",
    [("hydra", "mlp"), ("hydra", "prefix-mlp"), ("medusa", "mlp"), ("eagle", "eagle"), ("eagle", "eagle3")],
)
def test_drafting_several_rows_at_once_equals_drafting_each(tiny_cache, family, head_arch):
    """A batch drafts its rows in one call per depth: the proposals of one call per row, for rows
    whose committed lengths differ, and again after each row accepted a different number."""
    model, heads = tiny_cache("llama", family, head_arch)
    buffers = Tree.from_choices(MC_SIM_7B_63).buffers(torch.device("cpu"), torch.float64)
    g = torch.Generator().manual_seed(0)
    together, alone, rest = [], [], []
    for n in (3, 5, 8):
        ids = torch.randint(0, VOCAB, (1, n + 4), generator=g)
        feats = heads.features(model(ids, output_hidden_states=heads.hidden_states_request).hidden_states)[0]
        a, b = heads.new_state(model), heads.new_state(model)
        for state in (a, b):
            heads.observe(state, feats[:n], tokens=ids[0, :n])
        together.append(a), alone.append(b)
        rest.append((feats[n:], ids[0, n:]))  # the root at n, then what each row accepts
    accepted = (1, 2, 3)
    for step in range(2):
        offsets = [0] * 3 if step == 0 else list(accepted)
        roots = [t[k] for (_, t), k in zip(rest, offsets)]
        for temperature in (1.0, 0.7):
            got = heads.propose_rows(together, roots, buffers, temperature=temperature)
            for state, root, row in zip(alone, roots, got):
                want = heads.propose(state, root, buffers, temperature=temperature)
                assert torch.equal(row.tokens, want.tokens)
                torch.testing.assert_close(row.probs, want.probs)
                torch.testing.assert_close(row.entropy, want.entropy)
        if step == 0:
            for a, b, (h, t), k in zip(together, alone, rest, accepted):
                heads.observe(a, h[:k], tokens=t[:k])
                heads.observe(b, h[:k], tokens=t[:k])


@pytest.mark.parametrize("mode", ["append", "replace"])
def test_retrieval_rows_are_drafted_together_and_stay_lossless(tiny_cache, monkeypatch, mode):
    from entmtp_hf.trees.retrieval import RetrievalConfig

    model = enabled(tiny_cache)
    _, ids, mask = batch_of(lengths=(5, 9, 7, 12), seed=11)
    ids = torch.cat([ids, ids], dim=1)  # every prompt repeats: the retrieval index finds continuations
    mask = torch.cat([mask, mask], dim=1)
    calls = []
    cls = type(tiny_cache("llama", "hydra", "mlp")[1])
    original = cls.propose_rows

    def spy(self, states, roots, buffers, temperature=1.0):
        calls.append(len(states))
        return original(self, states, roots, buffers, temperature=temperature)

    monkeypatch.setattr(cls, "propose_rows", spy)
    config = EntMTPConfig(tree=MC_SIM_7B_63, retrieval=RetrievalConfig(num_tokens=3, mode=mode))
    out = generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False, entmtp_config=config)
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, plain)
    assert calls and max(calls) >= 2, "rows with a retrieval index should be drafted in one head call"


@pytest.mark.parametrize("family,head_arch", [("hydra", "mlp"), ("hydra", "prefix-mlp"), ("eagle", "eagle")])
def test_observing_several_rows_at_once_equals_observing_each(tiny_cache, family, head_arch):
    """A batch's commit conditions every row's heads in one call: the same states as one call per row."""
    model, heads = tiny_cache("llama", family, head_arch)
    buffers = Tree.from_choices(MC_SIM_7B_63).buffers(torch.device("cpu"), torch.float64)
    g = torch.Generator().manual_seed(0)
    together, alone, steps = [], [], []
    for n in (3, 5, 8):
        ids = torch.randint(0, VOCAB, (1, n + 3), generator=g)
        feats = heads.features(model(ids, output_hidden_states=heads.hidden_states_request).hidden_states)[0]
        a, b = heads.new_state(model), heads.new_state(model)
        heads.observe(a, feats[:n], tokens=ids[0, :n])
        heads.observe(b, feats[:n], tokens=ids[0, :n])
        together.append(a), alone.append(b)
        steps.append((feats[n:], ids[0, n:]))
    for k in (1, 3):  # rows accepting different lengths: 1, 2 and 3 new positions
        hiddens = [h[: min(k, i + 1)] for i, (h, _) in enumerate(steps)]
        tokens = [t[: min(k, i + 1)] for i, (_, t) in enumerate(steps)]
        heads.observe_rows(together, hiddens, tokens)
        for state, h, t in zip(alone, hiddens, tokens):
            heads.observe(state, h, t)
    for a, b, (_, t) in zip(together, alone, steps):
        assert a.num_observed == b.num_observed
        torch.testing.assert_close(a.cond, b.cond)
        pa, pb = heads.propose(a, t[-1], buffers), heads.propose(b, t[-1], buffers)
        assert torch.equal(pa.tokens, pb.tokens)
        torch.testing.assert_close(pa.probs, pb.probs)


# ----------------------------------------------------------------------------- one session for every batch size
@pytest.mark.parametrize("tree", [MC_SIM_7B_63, [[0], [0, 0], [0, 0, 0]]])
def test_a_static_cache_batch_equals_plain_batched_generate(tiny_cache, tree):
    """A static cache keeps every row (stopped rows verify their root alone): still every row as plain."""
    model = enabled(tiny_cache)
    singles, ids, mask = batch_of()
    eos = eos_ending_rows_apart(model, singles, 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    out = generate(
        model,
        ids,
        cache_implementation="static",
        entmtp_config=EntMTPConfig(tree=tree),
        return_dict_in_generate=True,
        **kwargs,
    )
    assert torch.equal(out.sequences, generate(model, ids, **kwargs))
    assert set(out.entmtp_stats["live_batch_sizes"]) == {len(LENGTHS)}  # no row left the forward


@pytest.mark.parametrize("how", ["object", "cache_implementation"])
def test_a_static_cache_sized_for_the_text_and_one_tree_holds_a_batch(tiny_cache, monkeypatch, how):
    """The shared cache grows each step by the longest accepted path of any row, which outgrows a static
    cache sized for prompt + answer + tree + a margin: the rows' seen slots move to its front when its
    room fills (cache.compact), and every row is still plain generate's."""
    from transformers import StaticCache

    import entmtp_hf.decoding.session as session_module

    compacted = []
    real = session_module.compact
    monkeypatch.setattr(session_module, "compact", lambda cache, index: compacted.append(1) or real(cache, index))
    model = enabled(tiny_cache)
    for seed in range(6):
        _, ids, mask = batch_of(seed=seed)
        kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[5] if seed % 2 else None)
        size = ids.shape[1] + 20 + len(MC_SIM_7B_63) + 1 + 4
        if how == "object":
            cache = dict(cache=StaticCache(config=model.config, max_cache_len=size))
        else:
            cache = dict(cache_implementation="static", max_cache_len=size)
        out = generate(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **cache, **kwargs)
        assert torch.equal(out, generate(model, ids, **kwargs)), f"seed {seed}"
    assert compacted  # the room did fill


def test_repetition_penalty_in_a_left_padded_batch(tiny_cache):
    """transformers builds the penalty with one prompt padding length per row: each row gets its own."""
    model = enabled(tiny_cache)
    _, ids, mask = batch_of()
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    out = generate(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **kwargs)
    assert torch.equal(out, generate(model, ids, **kwargs))


def test_prefix_constraints_get_each_rows_batch_id(tiny_cache):
    model = enabled(tiny_cache)
    _, ids, mask = batch_of()
    allowed = [list(range(1 + 3 * b, VOCAB, 2 + b)) for b in range(len(LENGTHS))]
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        prefix_allowed_tokens_fn=lambda batch_id, sent: allowed[batch_id],
    )
    out = generate(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **kwargs)
    assert torch.equal(out, generate(model, ids, **kwargs))


class EvenLastToken:
    """Stops a row whose last token is even once it is 6 tokens long or more (no EOS involved)."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] % 2 == 0) & (input_ids.shape[1] >= ids_width + 6)


ids_width = max(LENGTHS)


def rows_stopping_apart(model, eos: bool, cache: str) -> tuple[torch.Tensor, dict]:
    """The batch and generate keywords under which its rows stop at different steps: a criterion
    (and, with ``eos``, an EOS token each row reaches at its own step), on a dynamic or static cache."""
    from transformers import StoppingCriteriaList

    singles, ids, mask = batch_of()
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([EvenLastToken()]),
    )
    if eos:
        kwargs["eos_token_id"] = eos_ending_rows_apart(model, singles, 30)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    return ids, kwargs


@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_criterion_that_stops_one_row_behaves_as_in_plain_generate(tiny_cache, eos, cache):
    """Without an EOS criterion plain generate keeps decoding a stopped row (real tokens) until every
    row stops; with one it pads the stopped row. Either way the output is plain generate's."""
    model = enabled(tiny_cache)
    ids, kwargs = rows_stopping_apart(model, eos, cache)
    plain = generate(model, ids, **kwargs)
    for tree in (MC_SIM_7B_63, [[0]]):
        out = generate(model, ids, entmtp_config=EntMTPConfig(tree=tree), **kwargs)
        assert torch.equal(out, plain)


class Recorder(BaseStreamer):
    """Every ``put`` (a copy of its tensor) and whether ``end`` came last."""

    def __init__(self) -> None:
        self.puts, self.ended = [], False

    def put(self, value) -> None:
        assert not self.ended
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_batch_streams_as_plain_generate(tiny_cache, eos, cache):
    """A streamer gets what plain generate gives it for a batch: the prompts [B, L], then one [B]
    column per new token (a row stopped on EOS: the pad token), then ``end``; so what is streamed is
    what is returned. Rows stop apart (a criterion, EOS) and drafts accept several tokens per step."""
    model = enabled(tiny_cache)
    ids, kwargs = rows_stopping_apart(model, eos, cache)
    plain = Recorder()
    want = generate(model, ids, streamer=plain, **kwargs)
    assert plain.ended and len(plain.puts) == want.shape[1] - ids.shape[1] + 1
    for tree in (MC_SIM_7B_63, [[0]]):
        got = Recorder()
        out = generate(model, ids, streamer=got, entmtp_config=EntMTPConfig(tree=tree), **kwargs)
        assert torch.equal(out, want) and got.ended
        assert [tuple(p.shape) for p in got.puts] == [tuple(p.shape) for p in plain.puts]
        assert all(torch.equal(a, b) for a, b in zip(got.puts, plain.puts))


def test_a_row_of_padding_alone_without_a_mask(tiny_cache):
    """transformers infers an all-zero mask row from the pad id; plain generate decodes it, so does EntMTP."""
    model = enabled(tiny_cache)
    ids = torch.tensor([[0, 0, 5, 7], [0, 0, 0, 0]])
    kwargs = dict(max_new_tokens=8, do_sample=False)
    out = generate(model, ids, entmtp_config=EntMTPConfig(tree=[[0], [0, 0]]), **kwargs)
    assert torch.equal(out, generate(model, ids, **kwargs))
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    out = generate(model, ids, attention_mask=mask, entmtp_config=EntMTPConfig(tree=[[0], [0, 0]]), **kwargs)
    assert torch.equal(out, generate(model, ids, attention_mask=mask, **kwargs))
