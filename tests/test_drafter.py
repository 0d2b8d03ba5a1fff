"""The call's drafter without a session: one call drafts every row, as each row alone would."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_generation import CONFIGS
from tiny import VOCAB

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.decoding.session import Row
from entmtp_hf.drafting.drafter import RowDrafting, TreeDrafter
from entmtp_hf.scheduling.eas import EASConfig
from entmtp_hf.trees.retrieval import RetrievalConfig
from entmtp_hf.trees.tree import MC_SIM_7B_63

DRAFTERS = {
    **CONFIGS,
    "head_confidence": lambda: EntMTPConfig(
        trees=[[[0]], MC_SIM_7B_63], tau_on=0.2, tau_off=0.2, feature="head_confidence"
    ),
    "entropy": lambda: EntMTPConfig(tree=MC_SIM_7B_63, eas=EASConfig(warmup_tokens=0)),
    "retrieval": lambda: EntMTPConfig(tree=MC_SIM_7B_63, retrieval=RetrievalConfig(num_tokens=3, min_ngram=1)),
}


def rows_of(model, heads, drafter: TreeDrafter, texts: list[torch.Tensor]) -> list[RowDrafting]:
    """A fresh row per text, its heads conditioned on the text (the root excluded)."""
    rows = [drafter.new_row(heads.new_state(model)) for _ in texts]
    feats = [heads.features(model(t, output_hidden_states=heads.hidden_states_request).hidden_states)[0] for t in texts]
    drafter.observe(rows, [f[:-1] for f in feats], [t[0, :-1] for t in texts], [torch.zeros(VOCAB)] * len(texts))
    return rows


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafting_the_rows_together_equals_drafting_each_alone(tiny_cache, monkeypatch, name):
    """Rows that draft the union share one head call (``propose_rows``); every row's draft is the
    one it gets drafted alone, step after step (the rows learning different outcomes)."""
    model, heads = tiny_cache("llama", "hydra", "mlp")
    plan = DRAFTERS[name]().resolve(heads.num_heads, heads.config.draft_vocab_rows)
    drafter = TreeDrafter(heads, plan, device=torch.device("cpu"), dtype=model.dtype)
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, 4, (1, n), generator=g) for n in (5, 8, 11)]  # a small alphabet: n-grams recur
    together, alone = rows_of(model, heads, drafter, texts), rows_of(model, heads, drafter, texts)
    calls = []
    real = type(heads).propose_rows
    monkeypatch.setattr(type(heads), "propose_rows", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    for step in range(3):
        drafts = drafter.draft(together, texts)
        for i, (row, text) in enumerate(zip(alone, texts)):
            (want,) = drafter.draft([row], [text])
            got = drafts[i]
            assert torch.equal(got.tokens, want.tokens) and got.buffers is want.buffers
            assert (got.tree_index, got.branch_node) == (want.tree_index, want.branch_node)
            assert got.feature == pytest.approx(want.feature)  # the batched head call rounds in its own order
            assert torch.equal(got.tokens[:1], text[0, -1:])  # node 0 is the root
        accepted = [1 + (i + step) % 3 for i in range(len(texts))]
        accepted = [min(a, d.buffers.num_nodes) for a, d in zip(accepted, drafts)]
        for rows in (together, alone):
            drafter.learn(rows, drafts, accepted)
    shares_the_union = name not in ("entropy", "hysteresis", "ladder")  # those read base_top1 / entropies first
    assert (calls and max(calls) == 3) if shares_the_union else not calls


def test_the_index_is_extended_by_draft_only(tiny_cache):
    """The n-gram index takes the text at the start of ``draft`` (an explicit step); finding a
    continuation never extends it."""
    model, heads = tiny_cache("llama", "hydra", "mlp")
    plan = DRAFTERS["retrieval"]().resolve(heads.num_heads, heads.config.draft_vocab_rows)
    drafter = TreeDrafter(heads, plan, device=torch.device("cpu"), dtype=model.dtype)
    text = torch.tensor([[1, 2, 3, 1, 2]])
    (row,) = rows_of(model, heads, drafter, [text])
    assert row.index.tokens == []
    (draft,) = drafter.draft([row], [text])
    assert row.index.tokens == text[0].tolist() and row.index.continuation() == [3, 1, 2]
    assert row.index.tokens == text[0].tolist() and draft.branch_node is not None


def test_a_row_moving_to_another_plan_keeps_its_heads_state_text_and_statistics(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    eas = EASConfig(warmup_tokens=0)
    config = dict(eas=eas, retrieval=RetrievalConfig(num_tokens=3))
    big = EntMTPConfig(tree=MC_SIM_7B_63, **config).resolve(heads.num_heads, heads.config.draft_vocab_rows)
    small = EntMTPConfig(tree=[[0], [0, 0]], **config).resolve(heads.num_heads, heads.config.draft_vocab_rows)
    first = TreeDrafter(heads, big, device=torch.device("cpu"), dtype=model.dtype)
    text = torch.tensor([[1, 2, 3, 1, 2]])
    (row,) = rows_of(model, heads, first, [text])
    (draft,) = first.draft([row], [text])
    first.learn([row], [draft], [1])
    moved = TreeDrafter(heads, small, device=torch.device("cpu"), dtype=model.dtype).carry(row)
    assert moved.heads_state is row.heads_state and moved.index is row.index and moved.eas.stats is row.eas.stats
    assert moved.scheduler is not row.scheduler and moved.eas is not row.eas and moved.eas.k_max == 2


def test_per_row_drafting_state_is_small_plain_data():
    """A row's drafting state is a dataclass of at most ten fields, the session's row holds it and
    nothing else of drafting (the drafter, one for every row, is the session's)."""
    assert dataclasses.is_dataclass(RowDrafting) and len(dataclasses.fields(RowDrafting)) <= 10
    assert [f.name for f in dataclasses.fields(Row) if "Draft" in str(f.type)] == ["drafting"]
