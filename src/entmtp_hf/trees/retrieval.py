"""Retrieval branches as tree topology: their settings and how a branch joins a tree.

A retrieved continuation (tokens that followed an earlier occurrence of the text's latest
n-gram, found by :class:`~entmtp_hf.drafting.retrieval.NgramIndex`) is verified as one more
chain of the tree. In ``append`` mode it hangs from the root at the first free root rank
(:func:`with_branch`); in ``replace`` mode it is verified instead of the heads' tree. Banks,
plans and the cost model need only these shapes, not the index, so they live with the trees.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..validation import brief_list, brief_repr, choice, integer
from .tree import Tree

RETRIEVAL_MODES = ("append", "replace")
#: Most tokens one retrieved branch may carry: a plan precomputes one branch per length, and
#: every token is one more row to verify, so far longer branches only slow decoding down.
MAX_NUM_TOKENS = 32
#: Longest suffix matched: the index stores one entry per n-gram length and position.
MAX_NGRAM = 32
_FIELD = "RetrievalConfig"


@dataclass(frozen=True)
class RetrievalConfig:
    """Suffix lengths to match (longest first), the most tokens one branch may carry, and
    whether the branch joins the heads' tree (``append``) or is verified instead of it (``replace``)."""

    min_ngram: int = 2
    max_ngram: int = 4
    num_tokens: int = 4
    mode: str = "append"

    def __post_init__(self) -> None:
        choice(self.mode, f"{_FIELD}.mode", RETRIEVAL_MODES)
        object.__setattr__(self, "min_ngram", integer(self.min_ngram, f"{_FIELD}.min_ngram", low=1, high=MAX_NGRAM))
        object.__setattr__(
            self, "max_ngram", integer(self.max_ngram, f"{_FIELD}.max_ngram", low=self.min_ngram, high=MAX_NGRAM)
        )
        object.__setattr__(
            self, "num_tokens", integer(self.num_tokens, f"{_FIELD}.num_tokens", low=1, high=MAX_NUM_TOKENS)
        )

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
