"""Where a speculative output leaves plain decoding's, and whether the base model tied there.

Greedy EntMTP output equals plain ``generate`` token for token, up to floating point: a tree
forward and a one-token forward round differently, so where the base model's two best logits
(nearly) tie an argmax can flip. :func:`find_mismatch` names the first divergent token and
the base model's logit gap there, which tells a near-tie from a bug.
"""

from __future__ import annotations

from typing import Sequence

import torch


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter end); None when identical."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@torch.no_grad()
def find_mismatch(reference: Sequence[int], other: Sequence[int], model=None, prompt_ids=None) -> dict | None:
    """Where ``other`` leaves ``reference`` (both new-token lists); None when identical.

    With the model and prompt, adds the base model's logits at the divergent position
    (one teacher-forced forward over prompt + common prefix): ``logit_gap`` = logit of the
    reference token - logit of the other token (a near-zero gap is a floating-point near-tie).
    """
    pos = first_divergence(reference, other)
    if pos is None:
        return None
    ref_tok = reference[pos] if pos < len(reference) else None
    oth_tok = other[pos] if pos < len(other) else None
    out = {
        "position": pos,
        "reference_token": ref_tok,
        "token": oth_tok,
        "reference_length": len(reference),
        "length": len(other),
        "logit_gap": None,
        "top2_gap": None,
    }
    if model is not None and prompt_ids is not None and ref_tok is not None and oth_tok is not None:
        device = next(model.parameters()).device
        ids = torch.tensor([list(prompt_ids) + list(reference[:pos])], device=device)
        logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].double()
        top2 = logits.topk(2).values
        out["logit_gap"] = float(logits[ref_tok] - logits[oth_tok])
        out["top2_gap"] = float(top2[0] - top2[1])
    return out


def mismatch_text(m: dict) -> str:
    """One line for a mismatch: where, and whether the base model's logits tied there."""
    gap = m.get("logit_gap")
    where = f"{m['task']} from token {m.get('position')} on" if "task" in m else f"from token {m.get('position')} on"
    if gap is None:
        return where
    tie = (
        ", a floating-point tie: the tree's forward rounds differently from the one-token one"
        if abs(gap) < 1e-3
        else ""
    )
    return f"{where} (logit gap there {gap:.4f}{tie})"
