"""Draft heads for tree speculative decoding: Hydra (path-dependent) and Medusa (independent).

Public API:

* :class:`DraftHeads` (base), :class:`HydraHeads`, :class:`MedusaHeads`, registered by
  family name in :data:`HEADS_REGISTRY`;
* :class:`HeadsConfig`, :class:`DraftState`, :class:`Proposal`;
* :func:`load_heads` / :meth:`DraftHeads.from_pretrained` (own format, published Hydra and
  Medusa checkpoints, local folders or Hub repos) and :func:`convert_heads`.
"""

from .base import HEADS_REGISTRY, DraftHeads, DraftState, Proposal, register_heads
from .config import FORMAT_VERSION, HeadsConfig
from .files import HeadsLoadError
from .hydra import HydraHeads
from .loading import convert_heads, detect_format, load_heads
from .medusa import MedusaHeads

__all__ = [
    "FORMAT_VERSION",
    "HEADS_REGISTRY",
    "DraftHeads",
    "DraftState",
    "HeadsConfig",
    "HeadsLoadError",
    "HydraHeads",
    "MedusaHeads",
    "Proposal",
    "convert_heads",
    "detect_format",
    "load_heads",
    "register_heads",
]
