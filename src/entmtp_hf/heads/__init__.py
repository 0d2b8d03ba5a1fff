"""Draft heads for tree speculative decoding: Hydra (path-dependent), Medusa (independent),
EAGLE-style feature drafters, and a model's own multi-token-prediction (MTP) layers.

Public API:

* :class:`DraftHeads` (base), :class:`HydraHeads`, :class:`MedusaHeads`, :class:`EagleHeads`, :class:`MtpHeads`,
  each family registered in one :func:`register_family` call (:data:`FAMILIES`; the classes by name in
  :data:`HEADS_REGISTRY`);
* :class:`HeadsConfig`, :class:`DraftState`, :class:`Proposal`;
* :class:`HeadsCard` (with :class:`DataSource`, :class:`TokensPerStep`): what the heads'
  model card reports, saved as ``card.json``;
* :func:`load_heads` / :meth:`DraftHeads.from_pretrained` (own format, published Hydra and
  Medusa checkpoints, local folders or Hub repos) and :func:`convert_heads`;
* :meth:`DraftHeads.check_fits` and the errors :class:`HeadsLoadError` (a file) and
  :class:`HeadsMismatchError` (heads and a model that do not fit).
"""

from .base import HEADS_ATTR, DraftHeads, DraftState, HeadsMismatchError, Proposal
from .card import DataSource, HeadsCard, TokensPerStep
from .config import FORMAT_VERSION, HeadsConfig
from .eagle import EagleHeads
from .files import HeadsLoadError
from .hydra import HydraHeads

# The format modules register their readers on import, in this order: the own format first,
# so it wins over a published marker that an own-format config happens to hold as well.
from .loading import convert_heads, load_heads
from .medusa import MedusaHeads
from .mtp import MtpHeads
from .published import load_published_hydra, load_published_medusa  # noqa: F401 (registers the formats)
from .registry import FAMILIES, HEADS_REGISTRY, HeadsFamily, detect_format, register_family, register_format

__all__ = [
    "HEADS_ATTR",
    "FAMILIES",
    "FORMAT_VERSION",
    "HEADS_REGISTRY",
    "DataSource",
    "DraftHeads",
    "DraftState",
    "EagleHeads",
    "HeadsCard",
    "HeadsConfig",
    "HeadsFamily",
    "HeadsLoadError",
    "HeadsMismatchError",
    "HydraHeads",
    "MedusaHeads",
    "MtpHeads",
    "Proposal",
    "TokensPerStep",
    "convert_heads",
    "detect_format",
    "load_heads",
    "register_family",
    "register_format",
]
