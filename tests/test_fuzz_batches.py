"""Seeded fuzz of the batch surfaces and the cost cache, bounded for CI.

* Batches: random left-padded prompts (some all padding, with or without an attention mask),
  random logits processors that keep per-row state, row-wise stopping criteria with and
  without EOS, dynamic and static caches: greedy EntMTP equals plain ``generate`` token for
  token, or both refuse.
* The cost cache: random folders and files where the tables go (unusable folders, files
  where folders go, broken, foreign and oversized tables): ``calibrate`` and ``generate``
  never raise, warn instead, and leave no temporary file behind.
"""

from __future__ import annotations

import dataclasses
import json
import random
import warnings

import torch
from test_batch import PAD, enabled, generate
from tiny import VOCAB
from transformers import StoppingCriteria, StoppingCriteriaList

import entmtp_hf.calibration.tables as tables_module
from entmtp_hf import EntMTPConfig
from entmtp_hf.banks.bank import TopologyBank
from entmtp_hf.calibration import calibrate, tables_for
from entmtp_hf.calibration.store import key_for, table_path
from entmtp_hf.costs.fingerprint import machine_fingerprint, model_key
from entmtp_hf.costs.table import CostTable
from entmtp_hf.trees.tree import Tree

BATCH_CASES = 24
CACHE_CASES = 40
TREES = ([[0], [0, 0]], [[0], [1], [0, 0]], [[0], [0, 0], [0, 0, 0]])


class RowStop(StoppingCriteria):
    """Stops a row once its last token is even and the text is at least ``length`` long."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] % 2 == 0) & (input_ids.shape[1] >= self.length)


def _batch(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = rng.randint(2, 4), rng.randint(3, 8)
    ids = torch.full((rows, width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        n = 0 if rng.random() < 0.15 else rng.randint(1, width)
        ids[r, width - n :] = torch.tensor([rng.randrange(1, VOCAB) for _ in range(n)])
        mask[r, width - n :] = 1
    return ids, mask


def _processors(rng: random.Random) -> dict:
    choices = [
        {"repetition_penalty": rng.choice([1.2, 1.5])},
        {"no_repeat_ngram_size": rng.choice([2, 3])},
        {"min_new_tokens": rng.randint(1, 6)},
        {"bad_words_ids": [[rng.randrange(1, VOCAB)]]},
        {"sequence_bias": {(rng.randrange(1, VOCAB),): 5.0}},
        {"suppress_tokens": [rng.randrange(1, VOCAB)]},
        {"encoder_repetition_penalty": None},  # none at all
    ]
    kwargs: dict = {}
    for extra in rng.sample(choices, rng.randint(0, 3)):
        kwargs.update({k: v for k, v in extra.items() if v is not None})
    return kwargs


def _run(model, ids, kwargs):
    try:
        return generate(model, ids, **kwargs), None
    except (ValueError, TypeError) as e:  # refusals only; anything else fails the test
        return None, e


def test_fuzz_batches_with_processors_and_row_stopping(tiny_cache):
    model = enabled(tiny_cache)
    rng = random.Random(1234)
    compared = 0
    for case in range(BATCH_CASES):
        ids, mask = _batch(rng)
        kwargs = dict(max_new_tokens=rng.randint(2, 10), do_sample=False, **_processors(rng))
        if rng.random() < 0.7 or not bool((mask == 0).any()):
            kwargs["attention_mask"] = mask
        if rng.random() < 0.5:
            kwargs["stopping_criteria"] = StoppingCriteriaList([RowStop(ids.shape[1] + rng.randint(1, 5))])
        if rng.random() < 0.4:
            kwargs["eos_token_id"] = rng.randrange(1, VOCAB)
        if rng.random() < 0.3:
            kwargs["cache_implementation"] = "static"
        ref, ref_error = _run(model, ids, kwargs)
        out, error = _run(model, ids, {**kwargs, "entmtp_config": EntMTPConfig(tree=rng.choice(TREES))})
        where = f"case {case}: {kwargs}"
        if ref_error is not None:
            assert error is not None, f"{where}: plain generate refused ({ref_error}), EntMTP did not"
            continue
        assert error is None, f"{where}: EntMTP refused what plain generate decodes: {error!r}"
        assert torch.equal(out, ref), f"{where}\nplain  {ref.tolist()}\nentmtp {out.tolist()}"
        compared += 1
    assert compared >= BATCH_CASES * 2 // 3  # the fuzz mostly compares, not refuses


def _bank() -> TopologyBank:
    chain = [Tree.chain(d) for d in range(4)]
    per_tree = [{"num_nodes": t.num_nodes, "mean_accept_length": tau} for t, tau in zip(chain, (1.0, 1.6, 2.0, 2.2))]
    return TopologyBank(
        "t",
        chain,
        {"trees": per_tree, "frontier": {"trees": [0, 1, 2, 3]}, "scheduler": {"static": 3, "policy": "static"}},
    )


def _table(model, heads, batch_size: int = 1) -> CostTable:
    lm = model.get_output_embeddings().weight
    fp = machine_fingerprint(lm.device, lm.dtype)
    return CostTable(
        {**fp.to_dict(), "key": fp.key()},
        model_key(model, heads),
        {1: 10.0, 2: 10.0, 4: 15.0},
        (0.0, 0.0, 0.0),
        (0.0, 0.0),
        10.0,
        batch_size=batch_size,
    )


def _spoil(rng: random.Random, root, model, heads) -> str:
    """Something wrong where this machine's tables go; returns the cache folder to use."""
    costs = root / "costs"
    path = table_path(key_for(model, heads), costs)
    kind = rng.choice(
        [
            "file-as-root",
            "file-as-costs",
            "dir-as-table",
            "garbage",
            "truncated",
            "foreign",
            "wrong-batch",
            "huge",
            "not-object",
            "proc",
        ]
    )
    if kind == "proc":
        return "/proc/entmtp-hf-fuzz"
    if kind == "file-as-root":
        root.write_text("x")
        return str(root)
    if kind == "file-as-costs":
        root.mkdir()
        costs.write_text("x")
        return str(root)
    costs.mkdir(parents=True)
    good = _table(model, heads).to_dict()
    if kind == "dir-as-table":
        path.mkdir()
    elif kind == "garbage":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
    elif kind == "truncated":
        text = json.dumps(good)
        path.write_text(text[: rng.randrange(len(text))])
    elif kind == "foreign":
        path.write_text(json.dumps({**good, "model": "another", "fingerprint": {"key": "elsewhere"}}))
    elif kind == "wrong-batch":
        path.write_text(json.dumps({**good, "batch_size": rng.choice([2, 1024])}))
    elif kind == "huge":
        path.write_text(json.dumps({**good, "notes": {"pad": "x" * (2 << 20)}}))
    else:
        path.write_text(json.dumps(rng.choice([[1, 2], 3, "s", None])))
    return str(root)


def test_fuzz_the_cost_cache(tiny_cache, tmp_path, monkeypatch):
    model = enabled(tiny_cache)
    heads = model.entmtp_heads
    measured = []
    monkeypatch.setattr(tables_module, "probe", lambda m, h, **k: measured.append(1) or _table(m, h))
    monkeypatch.setattr(
        tables_module, "probe_batch", lambda m, h, base, b, **k: dataclasses.replace(base, batch_size=b)
    )
    rng = random.Random(99)
    ids = torch.tensor([[3, 5, 7, 9]])
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    config = EntMTPConfig(bank=_bank(), task="t")
    for case in range(CACHE_CASES):
        root = tmp_path / f"c{case}"
        monkeypatch.setenv("ENTMTP_HF_CACHE", _spoil(rng, root, model, heads))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = tables_for(model, heads, [1, 2])
            assert set(found) == {1, 2}
            out = model.generate(ids, max_new_tokens=6, do_sample=False, entmtp_config=config)
            tables = calibrate(model, batch_sizes=rng.choice([[1], [1, 2]]), progress=False)
        assert torch.equal(out, plain), f"case {case}"
        assert tables[1].key == key_for(model, heads), f"case {case}"
        assert all(issubclass(w.category, UserWarning) for w in caught), [str(w.message) for w in caught]
        if root.exists() and root.is_dir():
            assert not list(root.rglob(".*.tmp")), f"case {case}: a temporary file was left behind"
    assert measured  # every spoiled table was measured again rather than trusted
