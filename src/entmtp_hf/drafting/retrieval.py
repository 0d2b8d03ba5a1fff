"""Retrieval branches: continuations copied from earlier text, verified as one more tree branch.

Answers often repeat their prompt or themselves (code that reuses names, arithmetic that
restates numbers). When the last ``n`` tokens of the text (the tree's root included) occurred
before, the tokens that followed that earlier occurrence are a cheap guess of what comes
next. :class:`NgramIndex` finds the most recent earlier occurrence of the longest suffix of
``max_ngram`` down to ``min_ngram`` tokens, in O(1) per step, and returns up to
``num_tokens`` continuation tokens.

In ``append`` mode the continuation is attached to the scheduled tree as a chain hanging
from the root at the first free root rank (:func:`with_branch`); in ``replace`` mode it is
verified instead of the heads' tree (root + the chain; the heads skip drafting that step),
which keeps the verified tree inside the few rows a CPU matmul handles at the cost of one
(docs/performance.md). Either way it goes through the same verification as the heads' nodes:
greedy output stays identical and exact sampling stays exact (acceptance only asks whether
the verifier's own pick is among a node's children, however they were drafted). The heads
never draft below a retrieval node.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..files import brief_list, brief_repr
from ..trees.tree import Tree


RETRIEVAL_MODES = ("append", "replace")
#: Most tokens one retrieved branch may carry: a plan precomputes one branch per length, and
#: every token is one more row to verify, so far longer branches only slow decoding down.
MAX_NUM_TOKENS = 32
#: Longest suffix matched: the index stores one entry per n-gram length and position.
MAX_NGRAM = 32
_FIELD = "RetrievalConfig"


def _check_count(name: str, value: object, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_FIELD}.{name}", f"must be an integer, got {brief_repr(value)}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{_FIELD}.{name}", f"must lie in [{minimum}, {maximum}], got {brief_repr(value)}")


@dataclass(frozen=True)
class RetrievalConfig:
    """Suffix lengths to match (longest first), the most tokens one branch may carry, and
    whether the branch joins the heads' tree (``append``) or is verified instead of it (``replace``)."""

    min_ngram: int = 2
    max_ngram: int = 4
    num_tokens: int = 4
    mode: str = "append"

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in RETRIEVAL_MODES:
            raise ConfigError(f"{_FIELD}.mode", f"must be one of {RETRIEVAL_MODES}, got {brief_repr(self.mode)}")
        _check_count("min_ngram", self.min_ngram, 1, MAX_NGRAM)
        _check_count("max_ngram", self.max_ngram, self.min_ngram, MAX_NGRAM)
        _check_count("num_tokens", self.num_tokens, 1, MAX_NUM_TOKENS)

    @classmethod
    def from_dict(cls, raw: object) -> "RetrievalConfig":
        """From a bank's JSON (``{"mode": "replace", "num_tokens": 2}``; missing keys default)."""
        if not isinstance(raw, dict):
            raise ConfigError(_FIELD, f"retrieval settings must be a JSON object or null, got {brief_repr(raw)}")
        unknown = sorted(map(str, set(raw) - set(cls.__dataclass_fields__)))
        if unknown:
            listed, allowed = brief_list(map(brief_repr, unknown)), list(cls.__dataclass_fields__)
            raise ConfigError(_FIELD, f"unknown retrieval keys [{listed}]; allowed: {allowed}")
        return cls(**raw)


class NgramIndex:
    """The text so far and, per n-gram, where the token after its latest complete occurrence is."""

    def __init__(self, config: RetrievalConfig, tokens: list[int] | None = None) -> None:
        self.config = config
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.extend(tokens or [])

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens; every n-gram that now has a following token is indexed."""
        toks = self.tokens
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for tok in new_tokens:
            end = len(toks)  # the n-grams ending just before ``tok`` are followed by it
            for n in range(lo, min(hi, end) + 1):
                self._next[tuple(toks[end - n : end])] = end
            toks.append(tok)

    def continuation(self) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the longest recurring suffix ([] if none)."""
        toks, cfg = self.tokens, self.config
        for n in range(min(cfg.max_ngram, len(toks)), cfg.min_ngram - 1, -1):
            start = self._next.get(tuple(toks[len(toks) - n :]))
            if start is not None:
                return toks[start : start + cfg.num_tokens]
        return []


def with_branch(tree: Tree, length: int) -> tuple[Tree, list[int]]:
    """``tree`` plus a chain of ``length`` nodes under the root, at the first free root rank.

    Returns the new tree and, for each of its nodes, where its token comes from: ``i >= 0``
    is node ``i`` of ``tree``, ``-d`` the ``d``-th token (1-based) of the retrieved chain.
    """
    if length < 1:
        raise ValueError(f"a retrieval branch needs at least one token, got {length}")
    rank = 1 + max((p[0] for p in tree.paths), default=-1)
    branch = [(rank,) + (0,) * d for d in range(length)]
    out = Tree.from_choices([*tree.choices, *map(list, branch)])
    index = tree.node_index()
    sources = [0] + [index[p] if p in index else -len(p) for p in out.paths]
    return out, sources
