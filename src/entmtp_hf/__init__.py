"""entmtp-hf: tree speculative decoding with multi-token-prediction heads for Hugging Face transformers.

Typical use::

    from entmtp_hf import EntMTPConfig, enable_entmtp

    enable_entmtp(model, "path/or/hub-id/of/heads")
    out = model.generate(**inputs, entmtp_config=EntMTPConfig(bank="path/or/hub-id/of/bank", task="gsm8k"))

The runtime (what ``generate`` runs) needs only torch, transformers, safetensors and
huggingface-hub; the offline tools live in :mod:`entmtp_hf.tools` (extra ``[tools]``) and the
embedded demo in :mod:`entmtp_hf.demo`.
"""

from .assisted import EntropyAdaptiveCandidateGenerator
from .banks.bank import TopologyBank
from .calibration import calibrate
from .config import EntMTPConfig
from .cpu_kernels import CPUKernels
from .decoding.compiled import use_compiled_decoding
from .decoding.loop import EntMTPGenerateOutput
from .decoding.stats import PhaseTimer
from .drafting.drafter import TreeDrafter
from .errors import ConfigError, EntMTPError, FileFormatError
from .heads import DraftHeads, HydraHeads, MedusaHeads, load_heads
from .integration import EntMTPGenerationMixin, disable_entmtp, enable_entmtp
from .scheduling.eas import EASConfig
from .trees.retrieval import RetrievalConfig
from .trees.tree import MC_SIM_7B_63, Tree

__version__ = "0.2.0"

__all__ = [
    "MC_SIM_7B_63",
    "CPUKernels",
    "ConfigError",
    "DraftHeads",
    "EASConfig",
    "EntMTPConfig",
    "EntMTPError",
    "EntMTPGenerateOutput",
    "EntMTPGenerationMixin",
    "EntropyAdaptiveCandidateGenerator",
    "FileFormatError",
    "HydraHeads",
    "MedusaHeads",
    "PhaseTimer",
    "RetrievalConfig",
    "TopologyBank",
    "Tree",
    "TreeDrafter",
    "calibrate",
    "disable_entmtp",
    "enable_entmtp",
    "load_heads",
    "use_compiled_decoding",
]
