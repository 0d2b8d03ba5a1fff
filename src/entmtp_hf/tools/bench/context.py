"""The loaded model, tokenizer, heads and banks a benchmark run shares between its methods.

Whatever is expensive to build is built once per context and kept: each task's bank, each
method's config (its plan resolved once), the int8 draft model and the measured CPU kernels.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from ...banks.bank import SHIPPED_DIR, TopologyBank
from ...calibration import calibrate
from ...config import EntMTPConfig
from ...cpu_kernels import CPUKernels
from ...demo import DEMO_EAGLE_BANK, DEMO_EAGLE_HEADS, DEMO_HEADS, DEMO_MEDUSA_HEADS, SHIPPED_DRAFTERS

log = logging.getLogger("entmtp_hf.tools.bench")

DEFAULT_HEADS = {"hydra": DEMO_HEADS, "medusa": DEMO_MEDUSA_HEADS, "eagle": DEMO_EAGLE_HEADS}
#: banks searched for a family's own heads (methods on other families use the run's ``--bank``)
DEFAULT_FAMILY_BANKS = {"eagle": SHIPPED_DIR / DEMO_EAGLE_BANK}
DEFAULT_BANKS = (SHIPPED_DIR / "smollm2-135m-cpu", SHIPPED_DIR / "published-defaults")
RANDOM_HEADS_VOCAB = 4096  # random smoke-test heads draft from the first ids only (cheap on CPU)


def quantized_draft(model):
    """An int8 copy of ``model`` (dynamic quantisation of every ``nn.Linear``; CPU only) to
    draft with: the target's own vocabulary and weights at a quarter of the bytes per step,
    a draft/target pair that needs no second checkpoint and no training."""
    with warnings.catch_warnings():  # torch.ao's eager quantisation warns that it moved to torchao
        warnings.simplefilter("ignore")
        draft = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(model).float(), {torch.nn.Linear}, dtype=torch.qint8
        )
    return draft.eval()


@dataclass
class BenchContext:
    """The loaded model, tokenizer, heads and bank a run uses (built by :func:`load_context`)."""

    model: Any
    tokenizer: Any
    heads: dict[str, Any] = field(default_factory=dict)  # family -> DraftHeads
    heads_sources: dict[str, str] = field(default_factory=dict)
    missing_heads: dict[str, str] = field(default_factory=dict)  # family -> why absent
    bank_folder: Path | None = None
    #: family -> the bank folder of the methods on that family's heads (searched with them), else ``bank_folder``
    family_banks: dict[str, Path] = field(default_factory=dict)
    #: a prompt file's stem -> the bank task it is decoded with (``--bank-tasks unseen-code=humaneval``)
    bank_tasks: dict[str, str] = field(default_factory=dict)
    model_name: str = ""
    eas_config: str | None = None  # EAS settings file of ``eas-calibrated`` ({task} is replaced)
    batch_sizes: tuple[int, ...] = (1,)  # what the run decodes at: the step costs banks rank with
    _banks: dict[str, Any] = field(default_factory=dict, repr=False)
    _configs: dict[tuple, EntMTPConfig] = field(default_factory=dict, repr=False)
    _int8_draft: Any = field(default=None, repr=False)
    #: (model, heads) -> their measured CPU kernels (the ids of the context's objects, which it keeps alive)
    _kernels: dict[tuple[int, int], CPUKernels] = field(default_factory=dict, repr=False)
    _copies: dict[torch.dtype, tuple[Any, dict[str, Any]]] = field(default_factory=dict, repr=False)
    #: what a method's :meth:`~.methods.Method.prepare` set up for its timed call (packed weights,
    #: installed kernels), undone by :meth:`release` right after that call: outside the clock both ways
    _held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def hold(self, context: Any) -> Any:
        """Enter ``context`` until :meth:`release`."""
        return self._held.enter_context(context)

    def release(self) -> None:
        self._held.close()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def int8_draft(self):
        """The draft model of the draft-model methods (:func:`quantized_draft`), built once."""
        if self._int8_draft is None:
            self._int8_draft = quantized_draft(self.model)
        return self._int8_draft

    def in_dtype(self, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
        """A copy of the model and of every heads family in ``dtype``, made once: methods in another
        dtype run interleaved with the others on the same prompts."""
        if dtype not in self._copies:
            heads = {family: copy.deepcopy(h).to(dtype) for family, h in self.heads.items()}
            self._copies[dtype] = (copy.deepcopy(self.model).to(dtype), heads)
        return self._copies[dtype]

    def cpu_kernels(self, model=None, heads=None) -> CPUKernels:
        """The measured CPU kernels of ``model`` (default the context's) with ``heads`` (None: the
        model alone), measured once, when first asked for."""
        model = model if model is not None else self.model
        key = (id(model), id(heads))
        if key not in self._kernels:
            self._kernels[key] = CPUKernels(model, heads)
        return self._kernels[key]

    def enable(self, family: str, model=None, heads=None, *, kernels: bool = True) -> None:
        """Attach ``heads`` (default the ``family`` heads) to ``model`` (default the context's), on
        their measured CPU kernels as ``enable_entmtp``'s default runs (measured once), or on
        ``F.linear`` throughout; outside the clock."""
        from ...integration import enable_entmtp

        model = model if model is not None else self.model
        heads = heads if heads is not None else self.heads[family]
        enable_entmtp(model, heads, cpu_kernels=self.cpu_kernels(model, heads) if kernels else False)

    def calibrated(self, model, heads) -> None:
        """This machine's step costs for ``model`` as it runs now (its kernels included) and
        ``heads`` at the run's batch sizes: measured the first time (a progress bar), read from
        the cache after; called outside the clock before a method whose bank re-ranks its trees."""
        calibrate(model, heads, batch_sizes=self.batch_sizes)

    def kernel_choices(self) -> dict[str, str]:
        """What each measured set of CPU kernels chose (for the result's environment)."""
        names = {id(h): family for family, h in self.heads.items()}
        names.update({id(h): family for _, heads in self._copies.values() for family, h in heads.items()})
        dtypes = {id(m): str(dtype).removeprefix("torch.") for dtype, (m, _) in self._copies.items()}
        out = {}
        for (model, heads), k in self._kernels.items():
            name = names.get(heads, "model") + (f" ({dtypes[model]})" if model in dtypes else "")
            out[name] = k.describe()
        return out

    def bank(self, task: str, family: str = "hydra") -> TopologyBank:
        """The bank of ``task`` for methods on ``family``'s heads, falling back to the folder's
        ``default`` task (logged)."""
        key = (family, task)
        if key not in self._banks:
            folder = self.family_banks.get(family, self.bank_folder)
            if folder is None:
                raise ValueError("no tree bank folder given")
            if not Path(folder).is_dir():
                raise ValueError(f"no {family} bank at {folder} (search one with `entmtp-hf search --heads ...`)")
            tasks = TopologyBank.list_tasks(folder)
            wanted = self.bank_tasks.get(Path(task).stem, task)
            name = wanted if wanted in tasks else "default" if "default" in tasks else None
            if name is None:
                raise ValueError(f"bank {folder} has neither task {task!r} nor 'default' (has {tasks})")
            if name != wanted:
                log.info("bank %s has no task %r: using its 'default' trees", folder, wanted)
            self._banks[key] = TopologyBank.from_pretrained(folder, task=name)
        return self._banks[key]


def random_heads(model, family: str, seed: int = 0):
    """Random (untrained) heads for smoke runs; deterministic for a given seed."""
    from ...heads import HEADS_REGISTRY

    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(seed)
    arch = "eagle" if family == "eagle" else "mlp"
    heads = HEADS_REGISTRY[family].for_model(
        model, num_heads=4, arch=arch, draft_vocab=torch.arange(min(vocab, RANDOM_HEADS_VOCAB))
    )
    return heads.to(dtype=model.get_output_embeddings().weight.dtype).eval()


def _weights_digest(folder: str | os.PathLike) -> str:
    """Short sha256 of a local heads folder's weights (which checkpoint a run used)."""
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        return "n/a"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def default_bank_folder() -> Path | None:
    return next((p for p in DEFAULT_BANKS if p.is_dir()), None)


def _load_family(ctx: BenchContext, family: str, source, given: bool, random_missing: bool, seed: int) -> None:
    """Load one family's heads into ``ctx`` (or say why not, and use random heads if asked)."""
    from ...heads import load_heads

    if Path(source).is_dir() or given:
        try:
            ctx.heads[family] = load_heads(str(source), base_config=ctx.model.config).to(ctx.device).eval()
            ctx.heads_sources[family] = f"{source} (weights sha256 {_weights_digest(source)})"
            return
        except (ValueError, OSError) as e:
            ctx.missing_heads[family] = f"{family} heads at {source} could not be loaded: {e}"
    else:
        ctx.missing_heads[family] = f"no {family} heads at {source} (train them, or pass --random-heads)"
    if random_missing:
        ctx.heads[family] = random_heads(ctx.model, family, seed)
        ctx.heads_sources[family] = f"random (seed {seed}, draft vocab {RANDOM_HEADS_VOCAB})"
        log.warning("using RANDOM %s heads: %s", family, ctx.missing_heads.pop(family))


def default_drafters(model_id: str | None) -> tuple[dict[str, Path], dict[str, Path]]:
    """The heads each family loads and the banks searched for them when none are given: the demo
    model's three families, another demo model's shipped drafter alone, none for other models
    (whose SmolLM2 heads would not fit anyway: they are tried and reported)."""
    if model_id in SHIPPED_DRAFTERS:
        heads, bank = SHIPPED_DRAFTERS[model_id]
        return {"eagle": heads}, {"eagle": SHIPPED_DIR / bank}
    return dict(DEFAULT_HEADS), dict(DEFAULT_FAMILY_BANKS)


def load_context(
    model_id: str | None = None,
    *,
    heads: Mapping[str, str | os.PathLike | None] | None = None,
    random_missing: bool = False,
    bank: str | os.PathLike | None = None,
    family_banks: Mapping[str, str | os.PathLike | None] | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> BenchContext:
    """Load the base model (default: the demo model), the heads of each family and the bank."""
    from ..models import load_base_model

    model, tokenizer = load_base_model(model_id)
    model.to(device)
    ctx = BenchContext(model, tokenizer, model_name=model_id or "SmolLM2-135M-Instruct (demo, fp32)")
    default_heads, default_banks = default_drafters(model_id)
    for family in DEFAULT_HEADS:
        given, default = (heads or {}).get(family), default_heads.get(family)
        if given or default is not None:
            _load_family(ctx, family, given or default, bool(given), random_missing, seed)
        else:
            ctx.missing_heads[family] = f"no {family} heads ship for {model_id} (pass --{family}-heads)"
    ctx.bank_folder = Path(bank) if bank is not None else default_bank_folder()
    ctx.family_banks = {f: Path((family_banks or {}).get(f) or folder) for f, folder in default_banks.items()}
    if bank is None and ctx.bank_folder != DEFAULT_BANKS[0]:
        log.info("no bank at %s (run the tree search for this machine): using %s", DEFAULT_BANKS[0], ctx.bank_folder)
    log.info("heads: %s; bank: %s", ctx.heads_sources or "none", ctx.bank_folder)
    return ctx
