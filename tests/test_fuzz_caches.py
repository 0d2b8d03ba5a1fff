"""Seeded fuzz of caches carried across calls, bounded for CI.

Random conversations of 2-3 turns on one cache object: dynamic or static (roomy, or exactly the
``max_length - 1`` slots the longest call may fill), one row or a left-padded batch (with or
without EOS), on a full-attention, a hybrid and an every-layer-sliding model (window 3), each
turn plain or EntMTP with a random tree. Every turn's text equals plain ``generate`` making the
same calls on its own cache of the same kind, and after a one-row call the cache holds as many
tokens as plain's (a batch call hands EntMTP's back empty: the next turn prefills it all).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tiny import VOCAB
from transformers import DynamicCache, StaticCache

from entmtp_hf import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63

CASES = 24
ARCHS = ("llama", "gemma3", "mistral-window-3")
TREES = (MC_SIM_7B_63, [[0], [0, 0], [0, 0, 0]], [[0], [1], [0, 0], [1, 0]], [[0]])
PAD = 0


@dataclass
class Conversation:
    ids: torch.Tensor  # [B, W] the first prompt, left-padded
    mask: torch.Tensor
    turns: list[tuple[int, torch.Tensor]]  # (max_new_tokens, the user's next tokens [B, k]) per turn
    eos: list[int] | None
    modes: str  # per turn: "p" plain, "e" EntMTP
    trees: list
    static: bool


def _conversation(rng: random.Random) -> Conversation:
    rows, width = rng.choice([1, 1, 2, 3]), rng.randint(2, 9)
    ids = torch.full((rows, width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        n = width if r == 0 else rng.randint(1, width)
        ids[r, width - n :] = torch.tensor([rng.randrange(1, VOCAB) for _ in range(n)])
        mask[r, width - n :] = 1
    count = rng.randint(2, 3)
    turns = [
        (rng.randint(1, 12), torch.tensor([[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 5))]] * rows))
        for _ in range(count)
    ]
    modes = "".join(rng.choice("pe") for _ in range(count))
    modes = modes if "e" in modes else "e" + modes[1:]
    eos = [rng.randrange(1, VOCAB)] if rng.random() < 0.4 else None
    return Conversation(ids, mask, turns, eos, modes, [rng.choice(TREES) for _ in range(count)], rng.random() < 0.5)


def _talk(model, conv: Conversation, modes: str, cache) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Every turn's text, the cache's length after it, and each call's ``max_length - 1``."""
    ids, mask, texts, held, longest = conv.ids, conv.mask, [], [], []
    for mode, tree, (new, more) in zip(modes, conv.trees, conv.turns):
        extra = {"entmtp_config": EntMTPConfig(tree=tree)} if mode == "e" else {}
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=conv.eos,
            **extra,
        )
        texts.append(out)
        held.append(int(cache.get_seq_length()))
        longest.append(ids.shape[1] + new - 1)
        ids = torch.cat([out, more], dim=-1)
        mask = torch.cat([mask, torch.ones(mask.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=-1)
    return texts, held, longest


def _cache(model, static: bool, room: int = 512):
    return StaticCache(config=model.config, max_cache_len=room) if static else DynamicCache(config=model.config)


def test_fuzz_caches_carried_across_calls(tiny_cache):
    models = {arch: enable_entmtp(*tiny_cache(arch, "hydra", "mlp")) for arch in ARCHS}
    rng = random.Random(61)
    for case in range(CASES):
        arch = ARCHS[case % len(ARCHS)]
        model, conv = models[arch], _conversation(rng)

        plain, plain_held, longest = _talk(model, conv, "p" * len(conv.modes), _cache(model, conv.static))
        room = max(longest) if rng.random() < 0.5 else max(longest) + rng.randint(1, 100)
        if conv.static:  # plain again on the cache size this case uses (exactly what the longest call may fill)
            plain, plain_held, _ = _talk(model, conv, "p" * len(conv.modes), _cache(model, True, room))
        mine, held, _ = _talk(model, conv, conv.modes, _cache(model, conv.static, room))
        where = (
            f"case {case} ({arch}, {'static ' + str(room) if conv.static else 'dynamic'}, {conv.modes}, "
            f"rows {conv.ids.shape[0]}, eos {conv.eos})"
        )
        for turn, (a, b) in enumerate(zip(mine, plain)):
            assert torch.equal(a, b), f"{where}, turn {turn}\nplain  {b.tolist()}\nentmtp {a.tolist()}"
        for turn, mode in enumerate(conv.modes):
            expected = 0 if mode == "e" and conv.ids.shape[0] > 1 else plain_held[turn]
            assert held[turn] == expected, f"{where}, turn {turn}: the cache holds {held[turn]}, expected {expected}"
