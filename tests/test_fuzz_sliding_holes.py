"""Seeded fuzz of holes in the attention mask on sliding-window models, bounded for CI.

transformers' sliding window counts cache slots (``kv_idx > q_idx - window``), padding and
holes (zeros inside the mask) included, while the position ids skip them. Random prompts with
holes: one row (a hole may be its last token) and left-padded batches, the mask passed or
inferred by transformers from the pad token inside the prompt, dynamic caches (and static ones
for one row), windows 4 and 6 on a model whose every layer slides (Mistral) and on hybrids (Gemma 2 with
soft-capping, Gemma 3): greedy EntMTP equals plain ``generate`` token for token (float64).
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny import COMMON, SLIDING_ARCHS, VOCAB, fitted_heads

from entmtp_hf import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63

PAD = 0
CASES = 8
FAMILIES = ("mistral-sliding", "gemma2", "gemma3")
WINDOWS = (4, 6)
TREES = (MC_SIM_7B_63, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], [[0], [1], [0, 0], [1, 0], [0, 0, 0]])


def windowed(arch: str, window: int):
    """A tiny float64 ``arch`` (tests/tiny.py) with the given sliding window, EntMTP enabled."""
    config_cls, model_cls, extra = SLIDING_ARCHS[arch]
    torch.manual_seed(window)
    model = model_cls(config_cls(**{**COMMON, **extra, "sliding_window": window})).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return enable_entmtp(model, fitted_heads(model, steps=30))


def _prompts(rng: random.Random, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of up to three windows with 1-4 holes each: (ids, mask); a masked slot
    holds the pad token (so transformers infers the same mask) or, sometimes, a real one."""
    rows = 1 if rng.random() < 0.5 else rng.randint(2, 3)
    width = rng.randint(window, 3 * window)
    ids = torch.full((rows, width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        n = rng.randint(2, width)
        ids[r, width - n :] = torch.tensor([rng.randrange(1, VOCAB) for _ in range(n)])
        mask[r, width - n :] = 1
        # a batch's last column must be text (EntMTP refuses what looks like right padding)
        for j in rng.sample(range(width - n, width - (rows > 1)), min(rng.randint(1, 4), n - 1)):
            mask[r, j] = 0
            ids[r, j] = PAD if rng.random() < 0.8 else ids[r, j]
    return ids, mask


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_fuzz_holes_in_the_mask_on_sliding_windows(arch, window):
    model = windowed(arch, window)
    rng = random.Random(1000 * window + FAMILIES.index(arch))
    holes_in_reach = 0
    for case in range(CASES):
        ids, mask = _prompts(rng, window)
        kwargs = dict(max_new_tokens=rng.randint(6, 20), do_sample=False, pad_token_id=PAD)
        if rng.random() < 0.5 or not bool(((mask == 0) == (ids == PAD)).all()):
            kwargs["attention_mask"] = mask  # else transformers infers it from the pad token
        # a static cache for one row (a batch on a static cache is the static-cache fuzz's surface)
        if ids.shape[0] == 1 and rng.random() < 0.4:
            kwargs["cache_implementation"] = "static"
        ref = model.generate(ids, **kwargs)
        out = model.generate(ids, entmtp_config=EntMTPConfig(tree=rng.choice(TREES)), **kwargs)
        where = f"case {case}: mask {mask.tolist()} {kwargs}"
        assert torch.equal(out, ref), f"{where}\nplain  {ref.tolist()}\nentmtp {out.tolist()}"
        holes = (mask == 0) & (mask.cummax(dim=1).values == 1)  # zeros after a row's first token
        holes_in_reach += int(holes[:, -window:].any())  # in the prompt's last window: the first step sees them
    assert holes_in_reach >= CASES // 3  # the fuzz mostly puts holes inside the window, not only in the padding
