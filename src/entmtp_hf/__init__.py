"""entmtp-hf: tree speculative decoding with multi-token-prediction heads for Hugging Face transformers.

Typical use::

    from entmtp_hf import EntMTPConfig, enable_entmtp

    enable_entmtp(model, "path/or/hub-id/of/heads")
    out = model.generate(**inputs, entmtp_config=EntMTPConfig(bank="trees/...", task="gsm8k"))
"""

from .trees.bank import TopologyBank
from .config import EntMTPConfig
from .scheduling.eas import EASConfig
from .integration import EntMTPGenerateOutput, EntMTPGenerationMixin, disable_entmtp, enable_entmtp
from .heads import DraftHeads, HydraHeads, MedusaHeads, load_heads
from .trees.tree import MC_SIM_7B_63, Tree

__version__ = "0.1.0"

__all__ = [
    "MC_SIM_7B_63",
    "DraftHeads",
    "EASConfig",
    "EntMTPConfig",
    "EntMTPGenerateOutput",
    "EntMTPGenerationMixin",
    "HydraHeads",
    "MedusaHeads",
    "TopologyBank",
    "Tree",
    "disable_entmtp",
    "enable_entmtp",
    "load_heads",
]
