"""What a heads-training run is configured by: :class:`TrainConfig` and the constants
(data sources, split ids, demo model) that every other part of the training package shares.

Kept apart so that data, loss, loop and CLI can all import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...heads import FAMILIES, HEADS_REGISTRY
from ...trees.tree import MC_SIM_7B_63

DEMO_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SOURCES = ("distill", "gsm8k", "stdlib")
#: depth of mc_sim_7b_63, the tree the final tau check decodes with: fewer heads cannot draft it
TAU_TREE_DEPTH = max(len(path) for path in MC_SIM_7B_63)
SPLIT_TRAIN, SPLIT_VAL = 0, 1


@dataclass
class TrainConfig:
    """Everything a heads-training run depends on (saved with every checkpoint)."""

    model: str | None = field(default=None, metadata={"help": "base model id/folder; None = demo model"})
    family: str = ""  # "": the arch's family (eagle for the eagle archs, mtp for mtp, else hydra)
    arch: str = "mlp"
    num_heads: int = 4
    num_layers: int = 1  # hydra: blocks per head; eagle: decoder layers; mtp: MTP layers
    #: eagle: base hidden states fused into the feature besides the last; eagle3: the three fused states
    feature_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 8192
    work_dir: str = "runs/heads"
    run_name: str | None = None
    output: str | None = None
    init_from: str | None = None
    init_vocab: str = "heads"
    distill_dir: str | None = "data/distill"
    sources: tuple[str, ...] = SOURCES
    max_tokens: int = 600_000
    #: train on the documents after those a run with ``max_tokens=train_offset`` trained on (same sources, shares
    #: and seed); validation takes the held-out documents any run of the same ``max_tokens`` takes, so rounds compare
    train_offset: int = 0
    distill_share: float = 0.6
    val_fraction: float = 0.04
    max_seq_len: int = 512
    batch_tokens: int = 2048
    extract_batch_tokens: int = 4096
    teacher_dtype: str = "float32"
    reuse_cache: str | None = None
    epochs: int = 2
    max_steps: int | None = None
    lr: float = 1e-3
    fuse_lr: float = 0.0  # eagle --feature-layers: the fuse projection's lr (0: lr); added at zero, it may learn faster
    weight_decay: float = 0.0
    warmup_steps: int = 50
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    ce_weight: float = 0.0
    head_decay: float = 0.8
    mixed_precision: str = "no"
    save_every: int = 50
    eval_every: int = 200
    keep_checkpoints: int = 2
    save_dtype: str = "float16"
    seed: int = 0
    tau_prompts: int = 6
    tau_new_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.family:  # the family of the arch ("mlp", Hydra's and Medusa's: hydra)
            found = (f.name for f in FAMILIES.values() if self.arch in f.archs and self.arch != "mlp")
            self.family = next(found, "hydra")
        if self.family not in HEADS_REGISTRY:
            raise ValueError(f"family must be one of {sorted(HEADS_REGISTRY)}, got {self.family!r}")
        if self.schedule not in ("cosine", "linear"):
            raise ValueError(f"schedule must be 'cosine' or 'linear', got {self.schedule!r}")
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"save_dtype must be float16, bfloat16 or float32, got {self.save_dtype!r}")
        if self.init_vocab not in ("heads", "data"):
            raise ValueError(f"init_vocab must be 'heads' or 'data', got {self.init_vocab!r}")
        if self.teacher_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"teacher_dtype must be float32 or bfloat16, got {self.teacher_dtype!r}")
        bad = set(self.sources) - set(SOURCES)
        if bad:
            raise ValueError(f"unknown data sources {sorted(bad)}; choose from {SOURCES}")
        if self.train_offset < 0:
            raise ValueError(f"train_offset must be >= 0 tokens, got {self.train_offset}")
        if self.num_heads < 1 or self.batch_tokens < self.max_seq_len or self.draft_vocab_size < int(not self.mtp):
            raise ValueError(
                "need num_heads >= 1, batch_tokens >= max_seq_len and draft_vocab_size >= 1 (mtp: >= 0, 0 drafting "
                "over the whole vocabulary)"
            )
        if self.mtp and self.num_layers < 1:
            raise ValueError(f"mtp: need num_layers >= 1 MTP layers, got {self.num_layers}")
        if self.tau_prompts > 0 and self.num_heads < TAU_TREE_DEPTH:
            raise ValueError(
                f"tau_prompts checks the heads with mc_sim_7b_63, a tree of depth {TAU_TREE_DEPTH}, deeper "
                f"than num_heads {self.num_heads}: use {TAU_TREE_DEPTH} heads or more, or tau_prompts 0"
            )
        self.sources = tuple(self.sources)
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        if self.feature_layers:
            if self.arch not in ("eagle", "eagle3"):
                raise ValueError(
                    f"feature_layers name the base states an 'eagle' or 'eagle3' drafter fuses, not arch {self.arch!r}"
                )
            if min(self.feature_layers) < 0 or len(set(self.feature_layers)) != len(self.feature_layers):
                raise ValueError(
                    f"feature_layers must be distinct hidden-state indices >= 0, got {self.feature_layers}"
                )
            if self.arch == "eagle3" and len(self.feature_layers) != 3:
                raise ValueError(
                    f"an eagle3 drafter fuses three base states (low, middle, high), got feature_layers "
                    f"{self.feature_layers}"
                )
        self.run_name = self.run_name or f"{self.family}-{self.arch}"

    @property
    def mtp(self) -> bool:
        """Whether the run trains MTP layers (saved in transformers' native layout, trained over the whole
        vocabulary as ``generate(use_mtp=True)`` drafts; ``draft_vocab_size``: the drafting vocabulary
        saved beside them for EntMTP, 0 for none)."""
        return self.family == "mtp"

    def heads_feature_layers(self, base_config) -> list[int] | None:
        """The base hidden states the trained heads read: (eagle) ``feature_layers`` then the last one,
        (eagle3) the three ``feature_layers`` in ascending order, else the arch's default (``None``: the
        last alone). The teacher cache keeps all but the last.

        An eagle3 drafter's states are the inputs of base layers, each below the last layer's output:
        transformers returns that output after the final norm, the engines before it (vLLM's
        ``eagle_aux_hidden_state_layer_ids``), so a drafter trained on it would not serve there."""
        if self.arch == "eagle3" and self.feature_layers:
            depth = base_config.num_hidden_layers
            if max(self.feature_layers) >= depth:
                raise ValueError(
                    f"eagle3 feature_layers must be inputs of base layers, in [0, {depth - 1}] for this "
                    f"{depth}-layer model, got {self.feature_layers}: its last output is the normed state in "
                    "transformers and the unnormed one in the engines"
                )
            return sorted(self.feature_layers)
        if self.feature_layers:
            return [*self.feature_layers, -1]
        return HEADS_REGISTRY[self.family]._default_feature_layers(base_config, self.arch)
