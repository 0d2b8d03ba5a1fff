"""Verification logits: the LM head over a tree's rows, in the GEMM layout this machine runs fastest.

A tree forward needs logits for its N rows, ``hidden @ W.T`` with the ``[vocab, hidden]`` LM
head ``W`` (113 MB for the demo model, the largest single weight a step reads). How a CPU BLAS
runs that product for a few rows depends on the machine: on the AMD EPYC this project was
last measured on, MKL's ``F.linear`` costs 2.1×, 3.0× and 1.6× one row's time for 2, 3 and 4
rows (each row reads W again), while the same product laid out as ``(W @ hidden.T).T`` costs
0.6-0.85× of it (docs/performance.md, session 10). :class:`TreeLogits` times both layouts
once per row count, on random rows and the real weight, and keeps the faster; one row always
uses the model's own layout. (The decoder's own linear layers, tried the same way, gained
nothing in a real forward, so they are left alone.)

The decode loop then asks the model for no logits (``logits_to_keep`` = no position) and
computes them from the last hidden state (:func:`tree_forward`). That is only right where
the model's logits *are* ``hidden @ W.T`` (no bias, scale or soft-capping):
:meth:`TreeLogits.matches` checks it on the prefill's last position, every call, and the loop
keeps the model's own logits otherwise. Either layout is the same product; like verifying
several tokens at once, it may round differently from the model's one-token forward.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

LAYOUTS = ("linear", "transposed")
#: a position index selecting no position: the model computes no logits
NO_POSITIONS = torch.zeros(0, dtype=torch.long)
#: the attribute :func:`~entmtp_hf.generation.enable_entmtp` keeps a model's :class:`TreeLogits` under
LOGITS_ATTR = "entmtp_tree_logits"


def project(hidden: torch.Tensor, weight: torch.Tensor, layout: str) -> torch.Tensor:
    """``hidden [N, H] @ weight[V, H].T`` as ``F.linear`` (``linear``) or as ``(W @ h.T).T`` (``transposed``)."""
    if layout == "linear":
        return F.linear(hidden, weight)
    if layout == "transposed":
        return torch.mm(weight, hidden.t()).t()
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


class TreeLogits:
    """The LM head for verification forwards, in the faster layout per row count.

    ``repeats`` interleaved rounds time a row count the first time it is asked for;
    ``layouts`` may preset choices (tests, or a machine already measured).
    """

    def __init__(self, lm_head: torch.nn.Module, repeats: int = 5, layouts: dict[int, str] | None = None) -> None:
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or getattr(lm_head, "bias", None) is not None:
            raise ValueError("TreeLogits needs an LM head with a 2-D weight and no bias")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        bad = {n: v for n, v in (layouts or {}).items() if v not in LAYOUTS}
        if bad:
            raise ValueError(f"unknown layouts {bad}; choose from {LAYOUTS}")
        self.lm_head = lm_head
        self.repeats = repeats
        self.layouts: dict[int, str] = {1: "linear", **(layouts or {})}

    @property
    def weight(self) -> torch.Tensor:
        return self.lm_head.weight  # read at every call: follows the model across .to() and dtype changes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V]`` of last hidden states ``[N, H]``."""
        return project(hidden, self.weight, self.layout(hidden.shape[0], hidden))

    def layout(self, rows: int, like: torch.Tensor) -> str:
        """The layout for ``rows`` rows, timed now if this is the first time."""
        chosen = self.layouts.get(rows)
        if chosen is None:
            chosen = self.layouts[rows] = self._tune(rows, like)
        return chosen

    @torch.no_grad()
    def matches(self, hidden_row: torch.Tensor, logits_row: torch.Tensor) -> bool:
        """Whether the model's logits at a position are this head's product (no bias, scale, soft-cap)."""
        ours = F.linear(hidden_row.reshape(1, -1), self.weight)[0].to(logits_row.dtype)
        scale = float(logits_row.abs().max()) + 1.0
        return ours.shape == logits_row.shape and bool((ours - logits_row).abs().max() <= 1e-3 * scale)

    @torch.no_grad()
    def _tune(self, rows: int, like: torch.Tensor) -> str:
        """Time both layouts (interleaved rounds after one warm-up, medians) and return the faster."""
        x = torch.randn(rows, self.weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(like)
        sync = (lambda: torch.cuda.synchronize(x.device)) if x.device.type == "cuda" else (lambda: None)
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for r in range(self.repeats + 1):
            for layout in LAYOUTS:
                sync()
                t0 = time.perf_counter()
                project(x, self.weight, layout)
                sync()
                if r:
                    times[layout].append(time.perf_counter() - t0)
        return min(LAYOUTS, key=lambda layout: statistics.median(times[layout]))


def tree_forward(model, tree_logits: TreeLogits | None, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification forward: logits ``[N, V]`` and last hidden states ``[N, H]`` of batch row 0,
    the logits from ``tree_logits`` when given (the model then computes none), else the model's."""
    if tree_logits is None:
        out = model(**inputs, output_hidden_states=-1)
        return out.logits[0], out.hidden_states[-1][0]
    out = model(**inputs, output_hidden_states=-1, logits_to_keep=NO_POSITIONS.to(inputs["input_ids"].device))
    hidden = out.hidden_states[-1][0]
    return tree_logits(hidden), hidden
