"""What the heads learn and how well they do it: the distillation loss (KL to the base
model's distribution restricted to the drafting vocabulary), :class:`HeadsObjective` (the
module :mod:`accelerate` wraps), teacher-forced validation and the tau measurement.

Training and validation share :func:`teacher_logprobs` / :func:`head_targets`, hence one module.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...heads import DraftHeads
from .config import SOURCES, SPLIT_VAL
from .teacher import TeacherCache, held_out, pack


def teacher_logprobs(hidden: Tensor, lm_weight: Tensor, lm_bias: Tensor | None = None) -> Tensor:
    """log softmax of the base logits restricted to the drafting vocabulary: [B, T, V']."""
    return torch.log_softmax(
        F.linear(hidden.float(), lm_weight.float(), None if lm_bias is None else lm_bias.float()), dim=-1
    )


def head_targets(teacher_logp: Tensor, sup: Tensor, valid: Tensor, i: int) -> tuple[Tensor, Tensor]:
    """Teacher of head i: row t <-> position t+i+1 ([B, T-i-1, V']), and the row mask."""
    n = teacher_logp.shape[1] - i - 1
    return teacher_logp[:, i + 1 :], sup[:, :n] & valid[:, i + 1 :]


def distill_loss(
    student: list[Tensor],
    teacher_logp: Tensor,
    sup: Tensor,
    valid: Tensor,
    ce_weight: float = 0.0,
    head_decay: float = 1.0,
) -> tuple[Tensor, list[float]]:
    """Weighted mean over heads of KL(teacher || student) (+ CE on the teacher argmax)."""
    losses, weights = [], []
    for i, logits in enumerate(student):
        target, rows = head_targets(teacher_logp, sup, valid, i)
        if not rows.any():
            continue
        t, q = target[rows], torch.log_softmax(logits[rows].float(), dim=-1)
        loss = (t.exp() * (t - q)).sum(-1).mean()
        if ce_weight:
            loss = (1 - ce_weight) * loss + ce_weight * F.nll_loss(q, t.argmax(-1))
        losses.append(loss)
        weights.append(head_decay**i)
    if not losses:
        zero = sum(s.sum() for s in student) * 0.0
        return zero, []
    total = sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)
    return total, [loss.item() for loss in losses]


class HeadsObjective(nn.Module):
    """Heads + the frozen base embeddings and LM head; ``forward(batch)`` returns the loss.

    One module so that ``accelerator.prepare`` (DDP) sees the training forward.
    """

    def __init__(self, heads: DraftHeads, embed: nn.Module, lm_head: nn.Module, ce_weight: float, head_decay: float):
        super().__init__()
        self.heads, self.embed, self.lm_head = heads, embed, lm_head
        self.embed.requires_grad_(False)
        self.lm_head.requires_grad_(False)
        self.ce_weight, self.head_decay = ce_weight, head_decay

    def forward(
        self, ids: Tensor, hidden: Tensor, valid: Tensor, sup: Tensor, features: Tensor | None = None, **_: Tensor
    ) -> tuple[Tensor, list[float]]:
        """``features``: the states the heads read when they are not the last one alone (EAGLE-3, or
        an EAGLE-1 drafter fusing lower states)."""
        student = self.heads.forward_train(hidden if features is None else features, ids, self.embed, self.lm_head)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):  # teacher in float32
            w, b = self.heads._base_lm_rows(self.lm_head)
            teacher = teacher_logprobs(hidden, w, b)
        return distill_loss(student, teacher, sup, valid, self.ce_weight, self.head_decay)


# ============================================================================ evaluation
@torch.no_grad()
def evaluate_heads(
    heads: DraftHeads,
    embed: nn.Module,
    lm_head: nn.Module,
    cache: TeacherCache,
    batch_tokens: int = 4096,
    ks: np.ndarray | None = None,
) -> dict[str, Any]:
    """Per head: top-1 / top-5 agreement with the base greedy token at t+i+2 and mean KL."""
    ks = cache.split(SPLIT_VAL) if ks is None else ks
    n = heads.num_heads
    hit1, hit5, kl, rows_n = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    was_training = heads.training
    heads.eval()
    device = next(heads.parameters()).device
    vocab = heads.draft_vocab.to(device) if heads.draft_vocab is not None else None
    for batch in pack(ks, cache.seqs[:, 1], batch_tokens):
        b = {k: v.to(device) for k, v in cache.batch(batch, heads.feature_layers).items()}
        student = heads.forward_train(b.get("features", b["hidden"]), b["ids"], embed, lm_head)
        w, bias = heads._base_lm_rows(lm_head)
        teacher = teacher_logprobs(b["hidden"], w, bias)
        for i, logits in enumerate(student):
            target, rows = head_targets(teacher, b["sup"], b["valid"], i)
            if not rows.any():
                continue
            top = logits[rows].float().topk(min(5, logits.shape[-1]), dim=-1).indices
            top = vocab[top] if vocab is not None else top
            truth = b["greedy"][:, i + 1 :][rows]
            hit1[i] += (top[:, 0] == truth).sum().item()
            hit5[i] += (top == truth[:, None]).any(-1).sum().item()
            t, q = target[rows], torch.log_softmax(logits[rows].float(), dim=-1)
            kl[i] += (t.exp() * (t - q)).sum().item()
            rows_n[i] += rows.sum().item()
    heads.train(was_training)
    d = np.maximum(rows_n, 1)
    return {
        "top1": (hit1 / d).round(4).tolist(),
        "top5": (hit5 / d).round(4).tolist(),
        "kl": (kl / d).round(4).tolist(),
        "rows": rows_n.astype(int).tolist(),
    }


def tau_prompts(cache: TeacherCache, tokenizer, count: int, seed: int, val_fraction: float) -> list[list[int]]:
    """Held-out prompts: half from held-out distilled records, the rest held-out GSM8K train questions."""
    from ..data import datasets as D

    ks = [k for k in cache.split(SPLIT_VAL) if cache.seqs[k, 4] == SOURCES.index("distill")]
    out = [cache.ids(k)[: cache.seqs[k, 2] + 1].tolist() for k in ks[: (count + 1) // 2]]
    for i, p in enumerate(D.gsm8k_train_prompts()):
        if len(out) >= count:
            break
        if held_out(f"gsm8k-train-{i}", val_fraction, seed):
            out.append(D.render_prompt(tokenizer, p))  # a base model's: the question in completion form
    return out


@torch.no_grad()
def measure_tau(
    model,
    heads: DraftHeads,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    tree: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Mean accepted tokens per step of greedy EntMTP decoding with ``tree`` (default mc_sim_7b_63)."""
    from ...config import EntMTPConfig
    from ...integration import disable_entmtp, enable_entmtp
    from ...trees.tree import MC_SIM_7B_63

    enable_entmtp(model, copy.deepcopy(heads).float())
    steps, accepted, t0 = 0, 0, time.perf_counter()
    try:
        for p in tqdm(prompts, desc="tau", unit="prompt", disable=None):
            ids = torch.tensor([list(p)], device=next(model.parameters()).device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                entmtp_config=EntMTPConfig(tree=tree or MC_SIM_7B_63),
            )
            st = out.entmtp_stats
            steps += st["steps"]
            accepted += sum(st["accept_lengths"])
    finally:
        disable_entmtp(model)
    return {
        "mean_accept_length": accepted / max(steps, 1),
        "steps": steps,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
    }
