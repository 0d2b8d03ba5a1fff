"""The cost model of a decode step on one machine: what a tree costs, and the speed-up it buys.

One EntMTP step that verifies tree ``T`` (``N`` nodes, depth ``D``) costs, in milliseconds,

    step(T) = F(N) + draft(T) + overhead(N)

with ``F(N)`` the verification forward of ``N`` nodes after a cached prefix (measured at a grid
of sizes, linear in between), ``draft(T) = a + b·D + c·(N - 1)`` (Hydra drafts one batched head
call per depth, Medusa one call per head, the EAGLE-style drafter one layer call per depth) and
``overhead(N) = o + p·N`` (acceptance, the cache update, the heads' conditioning on the accepted
tokens, the loop). With ``τ(T)`` tokens per step and plain ``generate`` at ``P`` ms per token,
the modelled speed-up is ``τ(T)·P / step(T)``. A :class:`CostTable` holds these measurements for
one (machine, model, heads) and is plain JSON, so it is cached on disk and stored in banks.

**Batches.** A table measured at batch size ``B > 1`` holds ``F(N)`` for ``B`` rows of ``N``
nodes each and ``P`` as plain batched ``generate``'s ms per step (``B`` tokens); drafting and the
overhead are per row, measured at that batch size (rows draft and condition their heads together,
so a row of a batch costs less than a row alone), so a step costs ``F(N) + B·(draft(T) + overhead(N))``
and the modelled speed-up is the ratio of total tokens/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import FieldError, FileFormatError
from ..trees.tree import Tree
from ..validation import brief_repr, integer, mapping, number, numbers_in

#: the most forward sizes a table may hold (a probe measures about fifteen)
MAX_SIZES = 256
FORMAT_VERSION = 1
MAX_BATCH = 1024
#: the most nodes one measured forward verifies (a bank's whole node budget)
MAX_NODES = 2**16


def table_key(machine: str, model: str, batch_size: int = 1) -> str:
    """What a table is filed under: the machine's fingerprint key, the model key, and the batch size beyond 1."""
    return f"{machine}-{model}" + (f"-b{batch_size}" if batch_size > 1 else "")


def interpolate(values: dict[int, float], n: int) -> float:
    """``values[n]`` where measured, else linear between the nearest sizes around ``n`` (along
    the last two beyond the largest, never falling: more nodes never cost less, whatever the
    noise in the last two timings)."""
    if n in values:
        return values[n]
    sizes = sorted(values)
    if len(sizes) < 2 or n < sizes[0]:
        raise ValueError(f"no cost for {n} nodes (measured: {sizes})")
    above = [m for m in sizes if m > n]
    if not above:
        lo, hi = sizes[-2], sizes[-1]
        return values[hi] + max(values[hi] - values[lo], 0.0) * (n - hi) / (hi - lo)
    lo, hi = max(m for m in sizes if m < n), above[0]
    return values[lo] + (values[hi] - values[lo]) * (n - lo) / (hi - lo)


@dataclass(frozen=True)
class CostTable:
    """Measured step costs (ms) of one model and heads on one machine (see the module docstring)."""

    fingerprint: dict[str, Any]
    model: str  # :func:`~entmtp_hf.costs.fingerprint.model_key`
    forward_ms: dict[int, float]  # F(N)
    draft_ms: tuple[float, float, float]  # (a, b, c): a + b·depth + c·(nodes - 1)
    overhead_ms: tuple[float, float]  # (o, p): o + p·nodes
    plain_ms: float  # plain generate, per generated token
    seconds: float = 0.0  # how long measuring took
    format_version: int = FORMAT_VERSION
    notes: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1  # rows per forward the figures were measured at

    @property
    def key(self) -> str:
        """The machine's fingerprint key and the model key (and the batch size beyond 1): what a
        bank's entry is filed under."""
        return table_key(self.fingerprint.get("key", ""), self.model, self.batch_size)

    def forward(self, nodes: int) -> float:
        return interpolate(self.forward_ms, nodes)

    def drafting(self, tree: Tree) -> float:
        a, b, c = self.draft_ms
        return 0.0 if tree.num_nodes == 1 else max(a + b * tree.depth + c * (tree.num_nodes - 1), 0.0)

    def overhead(self, nodes: int) -> float:
        """A row's ms outside the forward and drafting in a step that verifies ``nodes`` nodes."""
        o, p = self.overhead_ms
        return max(o + p * nodes, 0.0)

    def step(self, tree: Tree) -> float:
        """Milliseconds of one EntMTP step that verifies ``tree``."""
        return self.forward(tree.num_nodes) + self.batch_size * (self.drafting(tree) + self.overhead(tree.num_nodes))

    def speedup(self, tree: Tree, tokens_per_step: float) -> float:
        """Modelled speed-up over plain ``generate`` of verifying ``tree`` every step."""
        return tokens_per_step * self.plain_ms / self.step(tree)

    def relative(self, tree: Tree) -> float:
        """A step's cost over one plain token's (what the value policy weighs trees by)."""
        return self.step(tree) / self.plain_ms

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["forward_ms"] = {str(n): v for n, v in sorted(self.forward_ms.items())}
        return d

    @classmethod
    def from_dict(cls, data: Any, source: str = "cost table") -> "CostTable":
        """Validated: every number finite, sizes positive and bounded; a problem names ``source``."""
        try:
            return cls._from_dict(data)
        except (TypeError, ValueError, KeyError) as e:
            raise FileFormatError(source, f"not a valid cost table ({e})") from None

    @classmethod
    def _from_dict(cls, data: Any) -> "CostTable":
        if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
            raise FieldError("format_version", f"must be {FORMAT_VERSION} (in a JSON object)")
        forward = data["forward_ms"]
        if not isinstance(forward, dict) or not 2 <= len(forward) <= MAX_SIZES:
            raise FieldError("forward_ms", f"must map 2 to {MAX_SIZES} sizes to milliseconds")
        sizes = {
            _size(n): number(v, f"forward_ms[{n}]", low=0.0, low_open=True, error=FieldError)
            for n, v in forward.items()
        }
        if min(sizes) != 1:
            raise FieldError("forward_ms", "must start at 1 node")
        draft = numbers_in(data["draft_ms"], "draft_ms", error=FieldError)
        overhead = numbers_in(data["overhead_ms"], "overhead_ms", error=FieldError)
        if len(draft) != 3 or len(overhead) != 2:
            raise FieldError("draft_ms", "needs 3 numbers and overhead_ms 2")
        if not isinstance(data["fingerprint"], dict) or not isinstance(data["model"], str):
            raise FieldError("fingerprint", "must be an object and model a string")
        batch = integer(data.get("batch_size", 1), "batch_size", low=1, high=MAX_BATCH, error=FieldError)
        plain = number(data["plain_ms"], "plain_ms", low=0.0, low_open=True, error=FieldError)
        seconds = number(data.get("seconds", 0.0), "seconds", error=FieldError)
        notes = mapping(data.get("notes"), "notes", optional=True, error=FieldError)
        return cls(
            dict(data["fingerprint"]),
            data["model"],
            sizes,
            draft,
            overhead,
            plain,
            seconds,
            FORMAT_VERSION,
            notes,
            batch,
        )


def _size(key: Any) -> int:
    """A number of nodes, as a JSON object's key (a string of digits) or an int."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(MAX_NODES)):
        key = int(key)
    return integer(key, f"forward_ms key {brief_repr(key)}", low=1, high=MAX_NODES, error=FieldError)
