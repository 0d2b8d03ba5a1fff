"""Retrieval branches: continuations copied from earlier text, verified as one more tree branch.

Answers often repeat their prompt or themselves (code that reuses names, arithmetic that
restates numbers). When the last ``n`` tokens of the text (the tree's root included) occurred
before, the tokens that followed that earlier occurrence are a cheap guess of what comes
next. :class:`NgramIndex` finds the most recent earlier occurrence of the longest suffix of
``max_ngram`` down to ``min_ngram`` tokens, in O(1) per step, and returns up to
``num_tokens`` continuation tokens.

In ``append`` mode the continuation is attached to the scheduled tree as a chain hanging
from the root at the first free root rank (:func:`~entmtp_hf.trees.retrieval.with_branch`); in ``replace`` mode it is
verified instead of the heads' tree (root + the chain; the heads skip drafting that step),
which keeps the verified tree inside the few rows a CPU matmul handles at the cost of one
(docs/performance.md). Either way it goes through the same verification as the heads' nodes:
greedy output stays identical and exact sampling stays exact (acceptance only asks whether
the verifier's own pick is among a node's children, however they were drafted). The heads
never draft below a retrieval node.
"""

from __future__ import annotations

from ..trees.retrieval import RetrievalConfig


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
