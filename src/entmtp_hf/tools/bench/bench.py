"""Benchmarks: one runner for every decoding method, results written as data.

Protocol (the paper's, scaled by presets): per task a deterministic basket of N prompts
(:func:`~entmtp_hf.tasks.evaluation_basket`, seed 123), chat template applied, batch size
1. Every method gets one warm-up generation that is not measured. The timed region is the
whole ``generate`` call, prefill included. Methods run *interleaved*: for prompt ``i`` every
method runs once, in an order rotated by ``i``, so machine drift hits all methods alike.
Greedy outputs are compared token for token with ``vanilla``; every mismatch is kept, with
the base model's logit gap at the first divergent position.

Methods are small :class:`Method` objects in a registry (:data:`METHODS`); a method whose
heads, bank or library support is missing is skipped with a logged reason. Add one with
:func:`register_method` (e.g. the entropy-adaptive ``eas`` method), or load a module that
registers methods with ``entmtp-hf bench --plugin my.module``.

The result JSON (``results.json``, format ``entmtp-bench`` v1) holds the settings, the
environment (versions, CPU/GPU, torch threads, date, git commit), every prompt's token ids
and one record per (task, prompt, method) with all per-prompt figures; tables and plots
are made from that file only (:mod:`entmtp_hf.bench_report`, ``entmtp-hf bench-report``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import functools
import importlib
import json
import logging
import os
import re
import resource
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ...demo import DEMO_HEADS, DEMO_MEDUSA_HEADS
from ...trees.bank import SHIPPED_DIR, TopologyBank
from .report import FORMAT, FORMAT_VERSION, environment, json_safe, read_results, summarize, write_results
from ...config import EntMTPConfig
from ...decoding.stats import PhaseTimer
from ...scheduling.eas import EASConfig, fixed_length
from ...trees.tree import Tree
from ...cpu_kernels import onednn_linears, packed_linears
from ..data.tasks import BUILTIN_TASKS, evaluation_basket
from ...trees.tree import MC_SIM_7B_63

log = logging.getLogger("entmtp_hf.bench")

#: preset name -> (prompts per task, max new tokens)
PRESETS = {"quick": (3, 64), "standard": (20, 128), "paper": (100, 256)}
DEFAULT_HEADS = {"hydra": DEMO_HEADS, "medusa": DEMO_MEDUSA_HEADS}
DEFAULT_BANKS = (SHIPPED_DIR / "smollm2-135m-cpu", SHIPPED_DIR / "published-defaults")
PERPLEXITY_METRIC = Path(__file__).resolve().parent.parent / "metrics" / "perplexity"
#: decoding modes: generate kwargs and the EntMTP acceptance rule (paper: T=0.7, typical ε=0.09, α=0.3)
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
MODES: dict[str, tuple[dict, dict]] = {
    "greedy": ({"do_sample": False}, {"acceptance": "greedy"}),
    "sampling": (SAMPLING, {"acceptance": "exact"}),
    "typical": (SAMPLING, {"acceptance": "typical", "posterior_threshold": 0.09, "posterior_alpha": 0.3}),
}
RANDOM_HEADS_VOCAB = 4096  # random smoke-test heads draft from the first ids only (cheap on CPU)


# ============================================================================ settings
@dataclass(frozen=True)
class BenchSettings:
    """What one benchmark run measures (validated on construction)."""

    tasks: tuple[str, ...] = BUILTIN_TASKS
    num_prompts: int = PRESETS["paper"][0]
    max_new_tokens: int = PRESETS["paper"][1]
    preset: str = "paper"  # the basket's name in reports ("custom" when N / tokens were overridden)
    mode: str = "greedy"
    methods: tuple[str, ...] = ()  # empty: every default method
    seed: int = 123
    warmup_tokens: int = 16
    max_input_tokens: int = 1400
    perplexity: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {list(MODES)}")
        for name in ("num_prompts", "max_new_tokens", "warmup_tokens", "max_input_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tasks:
            raise ValueError("give at least one task")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; registered: {list(METHODS)}")

    @property
    def method_names(self) -> tuple[str, ...]:
        return self.methods or tuple(n for n, m in METHODS.items() if m.default)


@dataclass
class Generation:
    """What one generate call produced: the new token ids and EntMTP's statistics if any."""

    new_ids: list[int]
    stats: dict | None = None
    assisted: bool = False  # transformers' assisted decoding: its first forward verifies drafts too


@dataclass
class BenchContext:
    """The loaded model, tokenizer, heads and bank a run uses (built by :func:`load_context`)."""

    model: Any
    tokenizer: Any
    heads: dict[str, Any] = field(default_factory=dict)  # family -> DraftHeads
    heads_sources: dict[str, str] = field(default_factory=dict)
    missing_heads: dict[str, str] = field(default_factory=dict)  # family -> why absent
    bank_folder: Path | None = None
    model_name: str = ""
    eas_config: str | None = None  # EAS settings file of ``eas-calibrated`` ({task} is replaced)
    _banks: dict[str, Any] = field(default_factory=dict, repr=False)
    _configs: dict[tuple, EntMTPConfig] = field(default_factory=dict, repr=False)
    _int8_draft: Any = field(default=None, repr=False)
    #: what a method's :meth:`Method.prepare` set up for its timed call (packed weights), undone
    #: by :meth:`release` right after that call: outside the clock both ways
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

    def bank(self, task: str) -> TopologyBank:
        """The bank of ``task``, falling back to the folder's ``default`` task (logged)."""
        if task not in self._banks:
            if self.bank_folder is None:
                raise ValueError("no tree bank folder given")
            tasks = TopologyBank.list_tasks(self.bank_folder)
            name = task if task in tasks else "default" if "default" in tasks else None
            if name is None:
                raise ValueError(f"bank {self.bank_folder} has neither task {task!r} nor 'default' (has {tasks})")
            if name != task:
                log.info("bank %s has no task %r: using its 'default' trees", self.bank_folder, task)
            self._banks[task] = TopologyBank.from_pretrained(self.bank_folder, task=name)
        return self._banks[task]


# ============================================================================ EAS methods
def eas_bench_config(ctx, task: str, acceptance: dict, eas: EASConfig | None = None) -> EntMTPConfig:
    """Benchmark factory: the Hydra head chain as deep as the heads go, halted by EAS."""
    depth = ctx.heads["hydra"].num_heads
    return EntMTPConfig(tree=Tree.chain(depth).choices, eas=eas or EASConfig(), **acceptance)


def fixed_chain_config(k: int):
    """Benchmark factory: the fixed head chain of length ``k`` (unavailable with fewer heads)."""
    def make(ctx, task: str, acceptance: dict) -> EntMTPConfig:
        return EntMTPConfig(tree=Tree.chain(k).choices, **acceptance)

    return make







def quantized_draft(model):
    """An int8 copy of ``model`` (dynamic quantisation of every ``nn.Linear``; CPU only) to
    draft with: the target's own vocabulary and weights at a quarter of the bytes per step,
    a draft/target pair that needs no second checkpoint and no training."""
    with warnings.catch_warnings():  # torch.ao's eager quantisation warns that it moved to torchao
        warnings.simplefilter("ignore")
        draft = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).float(), {torch.nn.Linear},
                                                       dtype=torch.qint8)
    return draft.eval()


# ============================================================================ methods
ConfigFactory = Callable[[BenchContext, str, dict], EntMTPConfig]


@dataclass(frozen=True)
class Method:
    """A decoding method: a name and how to call ``generate``.

    Plain methods pass ``generate_kwargs``; tree methods name a heads family and build an
    :class:`EntMTPConfig` per task with ``entmtp(ctx, task, acceptance_kwargs)``. Override
    :meth:`prepare` for anything else (it runs outside the timed region and returns the
    callable that is timed).
    """

    name: str
    description: str
    heads: str | None = None
    entmtp: ConfigFactory | None = None
    generate_kwargs: Mapping[str, Any] = field(default_factory=dict)
    default: bool = True  # part of the default method list

    def unavailable(self, ctx: BenchContext, task: str, mode: str) -> str | None:
        """Why this method cannot run on ``task`` (None when it can)."""
        if self.heads is not None and self.heads not in ctx.heads:
            return ctx.missing_heads.get(self.heads, f"no {self.heads} heads")
        if self.entmtp is not None:
            try:
                self._config(ctx, task, mode).resolve(ctx.heads[self.heads].num_heads)
            except (ValueError, OSError) as e:
                return str(e)
        return None

    def _config(self, ctx: BenchContext, task: str, mode: str) -> EntMTPConfig:
        key = (self.name, task, mode)
        if key not in ctx._configs:  # one config per (method, task): its plan is resolved once
            ctx._configs[key] = self.entmtp(ctx, task, dict(MODES[mode][1]))
        return ctx._configs[key]

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Callable[[torch.Tensor, dict], Generation]:
        """Set the model up for this method; returns ``run(input_ids, generate_kwargs)``."""
        from ...integration import enable_entmtp

        kwargs = dict(self.generate_kwargs)
        if self.entmtp is not None:
            enable_entmtp(ctx.model, ctx.heads[self.heads])  # a heads swap, outside the clock
            kwargs["entmtp_config"] = self._config(ctx, task, mode)
        return _runner(ctx, kwargs)


def _runner(ctx: BenchContext, kwargs: dict) -> Callable[[torch.Tensor, dict], Generation]:
    """The timed callable: ``generate`` with the method's ``kwargs`` on top of the basket's."""
    assisted = any(kwargs.get(k) is not None for k in ("assistant_model", "prompt_lookup_num_tokens"))

    def run(input_ids: torch.Tensor, gen_kwargs: dict) -> Generation:
        timer = PhaseTimer()
        observe = {"entmtp_observers": [timer]} if kwargs.get("entmtp_config") is not None else {}
        out = ctx.model.generate(input_ids, return_dict_in_generate=True, **gen_kwargs, **kwargs, **observe)
        new_ids = out.sequences[0, input_ids.shape[1] :].tolist()
        stats = getattr(out, "entmtp_stats", None)
        if observe:  # drafting against everything else a step does (verification, acceptance, commit)
            t = timer.seconds
            stats = {**stats, "draft_time": t["draft"], "verify_time": t["verify"] + t["accept"] + t["commit"]}
        return Generation(new_ids, stats, assisted)

    return run


#: name -> method; insertion order is the default run and report order.
METHODS: dict[str, Method] = {}


def register_method(method: Method, *, replace: bool = False) -> Method:
    """Add a method to :data:`METHODS` (e.g. ``eas``, the entropy-adaptive method)."""
    if method.name in METHODS and not replace:
        raise ValueError(f"method {method.name!r} is already registered (pass replace=True)")
    if method.heads is not None and method.heads not in ("hydra", "medusa"):
        raise ValueError(f"method {method.name!r}: unknown heads family {method.heads!r}")
    METHODS[method.name] = method
    return method


def _default_tree(ctx: BenchContext, task: str, acc: dict) -> EntMTPConfig:
    return EntMTPConfig(tree=MC_SIM_7B_63, **acc)


def _bank_policy(policy: str, **extra: Any) -> ConfigFactory:
    def make(ctx: BenchContext, task: str, acc: dict) -> EntMTPConfig:
        bank = ctx.bank(task)
        return EntMTPConfig(bank=bank, task=bank.task, policy=policy, **acc, **extra)

    return make


@dataclass(frozen=True)
class KernelReference(Method):
    """Plain ``generate`` with every linear layer of the model on oneDNN
    (:func:`~entmtp_hf.layouts.onednn_linears`): how much of a tree method's speed-up over
    vanilla the kernel alone would give plain decoding on this machine."""

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Callable[[torch.Tensor, dict], Generation]:
        run = _runner(ctx, dict(self.generate_kwargs))

        def timed(input_ids: torch.Tensor, gen_kwargs: dict) -> Generation:
            with onednn_linears(ctx.model):
                return run(input_ids, gen_kwargs)

        return timed


@dataclass(frozen=True)
class PackedWeights(Method):
    """The method run with the decoder's layers packed for oneDNN (:func:`~entmtp_hf.layouts.packed_linears`),
    packed before the clock starts and unpacked right after its timed call, as a session
    that keeps the model packed across many calls would run it."""

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Callable[[torch.Tensor, dict], Generation]:
        run = super().prepare(ctx, task, mode)
        if not ctx.hold(packed_linears(ctx.model)):
            raise RuntimeError(f"{self.name}: no layer of the model could be packed for oneDNN")
        return run


@dataclass(frozen=True)
class PackedKernelReference(PackedWeights, KernelReference):
    """Plain ``generate`` on the fastest kernels this project has: the decoder's layers packed,
    the LM head (never packed) on oneDNN."""


register_method(Method("vanilla", "plain autoregressive generate"))
register_method(KernelReference("vanilla-onednn", "plain generate, every linear layer on oneDNN (kernel reference)"))
register_method(PackedKernelReference("vanilla-packed", "plain generate, the decoder's layers packed and the LM head "
                                      "on oneDNN (kernel reference)", default=False))  # fmt: skip
register_method(Method("pld", "prompt lookup decoding (transformers)", generate_kwargs={"prompt_lookup_num_tokens": 10}))
register_method(Method("medusa-default", "Medusa heads + mc_sim_7b_63", heads="medusa", entmtp=_default_tree))
register_method(Method("hydra-default", "Hydra heads + mc_sim_7b_63", heads="hydra", entmtp=_default_tree))
register_method(Method("entmtp-static", "EntMTP*: the bank's static optimum", heads="hydra", entmtp=_bank_policy("static")))
register_method(Method("entmtp-tau", "EntMTPτ: hysteresis T-/T+", heads="hydra", entmtp=_bank_policy("hysteresis")))
register_method(PackedWeights("entmtp-static-packed", "EntMTP*, the decoder's layers packed for oneDNN", heads="hydra",
                              entmtp=_bank_policy("static"), default=False))  # fmt: skip
register_method(Method("entmtp-value", "EntMTP-v: per step, the bank's value tree with the most path value",
                       heads="hydra", entmtp=_bank_policy("value")))  # fmt: skip
register_method(Method("entmtp-ladder", "EntMTP-l: threshold ladder", heads="hydra", entmtp=_bank_policy("ladder")))
register_method(Method("entmtp-tau-retrieval", "EntMTPτ + a retrieval branch copied from earlier text", heads="hydra",
                       entmtp=_bank_policy("hysteresis", retrieval=True)))  # fmt: skip
register_method(Method("entmtp-tau-no-retrieval", "EntMTPτ without retrieval branches, whatever the bank's default",
                       heads="hydra", entmtp=_bank_policy("hysteresis", retrieval=False), default=False))  # fmt: skip
# Entropy-adaptive speculation (EAS) on the Hydra head chain and its fixed-chain baselines;
# opt-in (`--methods vanilla eas chain-4 ...`). Chains longer than the heads are skipped.
register_method(Method("eas", "EAS: Hydra head chain halted by entropy", heads="hydra", entmtp=eas_bench_config,
                       default=False))
register_method(Method("eas-w16", "EAS with a 16-token warm-up (the default waits 100 tokens)", heads="hydra",
                       entmtp=lambda ctx, task, acc: eas_bench_config(ctx, task, acc, EASConfig(warmup_tokens=16)),
                       default=False))  # fmt: skip
register_method(Method("eas-calibrated", "EAS with the task's calibrated settings (--eas-config)", heads="hydra",
                       entmtp=lambda ctx, task, acc: eas_bench_config(ctx, task, acc, calibrated_eas(ctx, task)),
                       default=False))  # fmt: skip
for _k in (2, 4, 8, 12):  # chain-2: the fastest fixed chain on a CPU (3 verified tokens at about one's cost)
    register_method(Method(f"chain-{_k}", f"fixed Hydra head chain, k={_k}", heads="hydra",
                           entmtp=fixed_chain_config(_k), default=False))


def calibrated_eas(ctx: BenchContext, task: str) -> EASConfig:
    """The ``--eas-config`` settings of ``task`` (``entmtp-hf eas-calibrate`` writes them)."""
    if ctx.eas_config is None:
        raise ValueError("eas-calibrated needs --eas-config (e.g. runs/eas-calibration-{task}/eas_config.json)")
    return EASConfig.from_json(ctx.eas_config.replace("{task}", Path(task).stem))


@dataclass(frozen=True)
class DraftMethod(Method):
    """Assisted decoding with the target's int8 copy as the draft model (``ctx.int8_draft()``)
    and EAS (or a fixed chain: :func:`~entmtp_hf.eas.fixed_length`) deciding each chain's length."""

    eas: EASConfig = field(default_factory=EASConfig)

    def unavailable(self, ctx: BenchContext, task: str, mode: str) -> str | None:
        if ctx.device.type != "cpu":
            return "the int8 draft (dynamic quantisation) runs on the CPU only"
        return None if ctx.heads else "eas_config needs a model enabled by enable_entmtp, i.e. some heads"

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Callable[[torch.Tensor, dict], Generation]:
        from ...integration import EntMTPGenerationMixin, enable_entmtp

        if not isinstance(ctx.model, EntMTPGenerationMixin):  # the heads are not used, only the generate hook
            enable_entmtp(ctx.model, next(iter(ctx.heads.values())))
        return _runner(ctx, {"assistant_model": ctx.int8_draft(), "eas_config": self.eas})


# The draft-model form of EAS against fixed chains, with the target's own int8 copy as the draft.
register_method(DraftMethod("draft-eas", "int8 draft model, chain halted by EAS (k_max 12, 16-token warm-up)",
                            eas=EASConfig(warmup_tokens=16), default=False))  # fmt: skip
for _k in (4, 8, 12):
    register_method(DraftMethod(f"draft-chain-{_k}", f"int8 draft model, fixed chain k={_k}", eas=fixed_length(_k),
                                default=False))  # fmt: skip


# ============================================================================ loading
def random_heads(model, family: str, seed: int = 0):
    """Random (untrained) heads for smoke runs; deterministic for a given seed."""
    from ...heads import HydraHeads, MedusaHeads

    cls = {"hydra": HydraHeads, "medusa": MedusaHeads}[family]
    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(seed)
    heads = cls.for_model(model, num_heads=4, draft_vocab=torch.arange(min(vocab, RANDOM_HEADS_VOCAB)))
    return heads.to(dtype=model.get_output_embeddings().weight.dtype).eval()


def _weights_digest(folder: str | os.PathLike) -> str:
    """Short sha256 of a local heads folder's weights (which checkpoint a run used)."""
    import hashlib

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


def load_context(
    model_id: str | None = None,
    *,
    heads: Mapping[str, str | os.PathLike | None] | None = None,
    random_missing: bool = False,
    bank: str | os.PathLike | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> BenchContext:
    """Load the base model (default: the demo model), the heads of each family and the bank."""
    from ...demo.model import load_base_model
    from ...heads import load_heads

    model, tokenizer = load_base_model(model_id)
    model.to(device)
    ctx = BenchContext(model, tokenizer, model_name=model_id or "SmolLM2-135M-Instruct (demo, fp32)")
    for family, default in DEFAULT_HEADS.items():
        source = (heads or {}).get(family) or default
        if Path(source).is_dir() or (heads or {}).get(family):
            try:
                ctx.heads[family] = load_heads(str(source), base_config=model.config).to(device).eval()
                ctx.heads_sources[family] = f"{source} (weights sha256 {_weights_digest(source)})"
                continue
            except (ValueError, OSError) as e:
                ctx.missing_heads[family] = f"{family} heads at {source} could not be loaded: {e}"
        else:
            ctx.missing_heads[family] = f"no {family} heads at {source} (train them, or pass --random-heads)"
        if random_missing:
            ctx.heads[family] = random_heads(model, family, seed)
            ctx.heads_sources[family] = f"random (seed {seed}, draft vocab {RANDOM_HEADS_VOCAB})"
            log.warning("using RANDOM %s heads: %s", family, ctx.missing_heads.pop(family))
    ctx.bank_folder = Path(bank) if bank is not None else default_bank_folder()
    if bank is None and ctx.bank_folder != DEFAULT_BANKS[0]:
        log.info("no bank at %s (run the tree search for this machine): using %s", DEFAULT_BANKS[0], ctx.bank_folder)
    log.info("heads: %s; bank: %s", ctx.heads_sources or "none", ctx.bank_folder)
    return ctx


# ============================================================================ memory
class PeakMemory:
    """Peak memory of one generation: CUDA allocator peak, or peak RSS on the CPU.

    On Linux the RSS high-water mark (VmHWM) is reset before each generation through
    ``/proc/self/clear_refs``; where that is not allowed the process-lifetime
    ``ru_maxrss`` is reported instead (``source`` says which).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.source = "torch.cuda.max_memory_allocated"
        elif self._clear_refs():
            self.source = "VmHWM (peak RSS, reset per generation)"
        else:
            self.source = "ru_maxrss (peak RSS over the process lifetime)"

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.source.startswith("VmHWM"):
            self._clear_refs()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.source.startswith("VmHWM"):
            found = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
            if found:
                return int(found.group(1)) * 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ============================================================================ runner
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gen_kwargs(ctx: BenchContext, settings: BenchSettings, max_new_tokens: int) -> dict:
    kwargs = dict(MODES[settings.mode][0], max_new_tokens=max_new_tokens)
    eos = ctx.tokenizer.eos_token_id
    pad = ctx.model.generation_config.pad_token_id
    kwargs["pad_token_id"] = pad if pad is not None else eos
    return kwargs


def _prompt_ids(ctx: BenchContext, prompt, settings: BenchSettings) -> list[int]:
    ids = prompt.render(ctx.tokenizer)
    if len(ids) > settings.max_input_tokens:
        log.warning("%s: %d prompt tokens, keeping the last %d", prompt.prompt_id, len(ids), settings.max_input_tokens)
        ids = ids[-settings.max_input_tokens :]
    return ids


class _ForwardCounter:
    """Counts base-model forward calls (prefill + one per decoding step)."""

    def __init__(self, model) -> None:
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def rotation(names: Sequence[str], index: int) -> list[str]:
    """Run order of the methods for prompt ``index``: the list rotated by ``index``."""
    if not names:
        return []
    k = index % len(names)
    return list(names[k:]) + list(names[:k])


def _record(task, prompt_index, prompt, method, gen: Generation, elapsed, forwards, peak) -> dict:
    stats = gen.stats or {}
    new = len(gen.new_ids)
    # steps = verification forwards; tree methods prefill first, assisted decoding verifies from its first forward
    prefill = 0 if gen.assisted else 1
    steps = len(stats["accept_lengths"]) if "accept_lengths" in stats else max(forwards - prefill, 0)
    rec = {
        "task": task,
        "prompt_index": prompt_index,
        "prompt_id": prompt.prompt_id,
        "method": method,
        "new_tokens": new,
        "time_s": elapsed,
        "tokens_per_s": new / elapsed if elapsed > 0 else None,
        "forwards": forwards,
        "steps": steps,
        "mean_accept_length": (new - prefill) / steps if steps else None,  # tokens per verification step
        "peak_memory_bytes": peak,
        "output_ids": list(gen.new_ids),
    }
    for key in ("accept_lengths", "tree_indices", "tree_sizes", "features", "drafted_tokens", "accepted_draft_tokens", "eas"):
        rec[key] = stats.get(key)
    for key in ("draft_time", "verify_time", "prefill_time"):
        rec[f"{key}_s"] = stats.get(key)
    if isinstance(stats.get("eas"), dict):  # a method's own statistics (e.g. EAS) ride along
        rec["eas"] = stats["eas"]
    return rec


def _warm_up(ctx, methods, baskets, settings, available: dict[str, set]) -> dict[str, str]:
    """One unmeasured generation per method (first prompt of its first task in ``baskets``).

    Returns ``{method: reason}`` for methods that failed here; they are skipped.
    """
    kwargs = _gen_kwargs(ctx, settings, min(settings.warmup_tokens, settings.max_new_tokens))
    failed = {}
    for m in methods:
        label = next((t for t in baskets if t in available[m.name]), None)
        if label is None:
            continue
        try:
            input_ids = torch.tensor([baskets[label][2][0]], device=ctx.device)
            m.prepare(ctx, label, settings.mode)(input_ids, kwargs)
        except Exception as e:  # noqa: BLE001 - any failure means: skip this method, say why
            failed[m.name] = f"warm-up failed: {type(e).__name__}: {e}"
            log.warning("skipping %s: %s", m.name, failed[m.name])
        finally:
            ctx.release()
    return failed


def _availability(ctx, methods, baskets, settings, skipped: dict) -> dict[str, set]:
    """Per method, the tasks it can run on; the reasons for the others go into ``skipped``."""
    available: dict[str, set] = {m.name: set() for m in methods}
    for m in methods:
        for label in baskets:
            why = m.unavailable(ctx, label, settings.mode)
            if why is None:
                available[m.name].add(label)
            else:
                log.warning("skipping %s on %s: %s", m.name, label, why)
                skipped.setdefault(m.name, {})[label] = why
    for name, why in _warm_up(ctx, methods, baskets, settings, available).items():
        skipped.setdefault(name, {}).update({label: why for label in baskets})
        available[name] = set()
    return available


class _Meter:
    """Times one generation (clock read twice), its forwards and its peak memory."""

    def __init__(self, ctx: BenchContext, clock: Callable[[], float]) -> None:
        self.device, self.clock = ctx.device, clock
        self.memory, self.counter = PeakMemory(self.device), _ForwardCounter(ctx.model)

    def measure(self, run, input_ids, gen_kwargs) -> tuple[Generation, float, int, int]:
        self.memory.reset()
        self.counter.count = 0
        _sync(self.device)
        t0 = self.clock()
        gen = run(input_ids, gen_kwargs)
        _sync(self.device)
        elapsed = self.clock() - t0
        return gen, elapsed, self.counter.count, self.memory.peak_bytes()


def _completed_prompts(resume: dict | None, results: dict, methods, available, task: str) -> set[tuple[str, int]]:
    """(task, prompt index) pairs of ``task`` in ``resume`` that hold a record of every method to run."""
    if not resume:
        return set()
    def normal(d: dict) -> str:  # compare as the JSON file holds them (tuples -> lists)
        return json.dumps(json_safe({k: v for k, v in d.items() if k != "warmup_tokens"}), sort_keys=True)

    if normal(resume["settings"]) != normal(results["settings"]) or resume["prompts"] != results["prompts"]:
        raise ValueError("cannot resume: the earlier run used other settings or prompts")
    seen: dict[tuple[str, int], set] = {}
    for r in resume["records"]:
        if r["task"] == task:
            seen.setdefault((task, r["prompt_index"]), set()).add(r["method"])
    wanted = {m.name for m in methods if task in available[m.name]}
    return {key for key, ran in seen.items() if wanted <= ran}


def run_benchmark(
    ctx: BenchContext,
    settings: BenchSettings,
    *,
    clock: Callable[[], float] = time.perf_counter,
    out_path: str | os.PathLike | None = None,
    resume: dict | None = None,
) -> dict:
    """Run every method on every task's basket, interleaved; returns the result dict.

    ``clock`` is read only around measured generations (twice each). With ``out_path``
    the JSON is rewritten after every prompt, so a long run leaves partial results;
    ``resume`` (such a partial result of the same settings) keeps its complete prompts
    and runs only the others.
    """
    methods = [METHODS[n] for n in settings.method_names]
    results = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "settings": asdict(settings) | {"methods": list(settings.method_names)},
        "environment": environment(ctx.device, PeakMemory(ctx.device).source),
        "context": {"model": ctx.model_name, "heads": dict(ctx.heads_sources), "bank": str(ctx.bank_folder),
                    "eas_config": ctx.eas_config},  # fmt: skip
        "skipped": {},
        "prompts": {},
        "records": [],
    }
    baskets = {}
    for task in settings.tasks:
        basket = evaluation_basket(task, settings.num_prompts)
        label = basket[0].task if basket else task
        baskets[label] = (task, basket, [_prompt_ids(ctx, p, settings) for p in basket])
        results["prompts"][label] = [{"prompt_id": p.prompt_id, "input_ids": ids} for p, ids in zip(basket, baskets[label][2])]
    meter, gen_kwargs = _Meter(ctx, clock), _gen_kwargs(ctx, settings, settings.max_new_tokens)
    try:
        for label, (_, basket, all_ids) in baskets.items():
            # per task, when it starts: its bank is read (and its methods warmed up) only now
            available = _availability(ctx, methods, {label: baskets[label]}, settings, results["skipped"])
            done = _completed_prompts(resume, results, methods, available, label)
            if done:
                results["records"] += [r for r in resume["records"] if (r["task"], r["prompt_index"]) in done]
                results.setdefault("resumed", {"from": resume["environment"].get("date_utc"), "prompts": 0})
                results["resumed"]["prompts"] += len(done)
                log.info("resuming %s: %d prompts already complete", label, len(done))
            names, t_task = [m.name for m in methods if label in available[m.name]], time.perf_counter()
            for i, (prompt, ids) in enumerate(zip(basket, all_ids)):
                if (label, i) in done:
                    continue
                input_ids = torch.tensor([ids], device=ctx.device)
                for position, name in enumerate(rotation(names, i)):
                    run = METHODS[name].prepare(ctx, label, settings.mode)  # outside the clock
                    torch.manual_seed(settings.seed * 100_003 + i)  # same seed for every method of a prompt
                    measured = meter.measure(run, input_ids, gen_kwargs)
                    ctx.release()  # whatever the method held for its timed call (outside the clock)
                    rec = _record(label, i, prompt, name, *measured)
                    rec.update(order=len(results["records"]), rotation_position=position, prompt_tokens=len(ids))
                    results["records"].append(rec)
                prompt_records = [r for r in results["records"] if r["task"] == label and r["prompt_index"] == i]
                postprocess(ctx, prompt_records, results["prompts"][label], settings)
                log.info("%s prompt %d/%d done", label, i + 1, len(basket))
                if out_path is not None:  # a long run leaves complete per-prompt results behind
                    write_results(results, out_path)
            log.info("%s: %d prompts in %.0f s", label, len(basket), time.perf_counter() - t_task)
    finally:
        ctx.release()
        meter.counter.close()
    results["environment"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["summary"] = summarize(results)
    if out_path is not None:
        write_results(results, out_path)
    return results


# ============================================================================ post-processing
def postprocess(ctx: BenchContext, records: list[dict], prompts: list[dict], settings: BenchSettings) -> None:
    """Speedups over vanilla, greedy mismatch checks and response perplexity, in place."""
    vanilla = {r["prompt_index"]: r for r in records if r["method"] == "vanilla"}
    for r in records:
        base = vanilla.get(r["prompt_index"])
        ok = base is not None and base["tokens_per_s"] and r["tokens_per_s"] is not None
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if ok else None
        r["mismatch"] = None
        if settings.mode == "greedy" and base is not None and r is not base:
            prompt_ids = prompts[r["prompt_index"]]["input_ids"]
            r["mismatch"] = find_mismatch(base["output_ids"], r["output_ids"], ctx.model, prompt_ids)
            if r["mismatch"] is not None:
                log.warning("%s %s prompt %d: output differs from vanilla: %s",
                            r["task"], r["method"], r["prompt_index"], r["mismatch"])  # fmt: skip
    if settings.perplexity:
        add_perplexity(ctx, records, prompts)


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter end); None when identical."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@torch.no_grad()
def find_mismatch(reference: Sequence[int], other: Sequence[int], model=None, prompt_ids=None) -> dict | None:
    """Where ``other`` leaves ``reference`` (both new-token lists); None when identical.

    With the model and prompt, adds the base model's logits at the divergent position
    (one teacher-forced forward over prompt + common prefix): ``logit_gap`` = logit of the
    reference token - logit of the other token (a near-zero gap is an fp near-tie).
    """
    pos = first_divergence(reference, other)
    if pos is None:
        return None
    ref_tok = reference[pos] if pos < len(reference) else None
    oth_tok = other[pos] if pos < len(other) else None
    out = {"position": pos, "reference_token": ref_tok, "token": oth_tok,
           "reference_length": len(reference), "length": len(other), "logit_gap": None, "top2_gap": None}  # fmt: skip
    if model is not None and prompt_ids is not None and ref_tok is not None and oth_tok is not None:
        device = next(model.parameters()).device
        ids = torch.tensor([list(prompt_ids) + list(reference[:pos])], device=device)
        logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].double()
        top2 = logits.topk(2).values
        out["logit_gap"] = float(logits[ref_tok] - logits[oth_tok])
        out["top2_gap"] = float(top2[0] - top2[1])
    return out


@functools.lru_cache(maxsize=1)
def perplexity_metric():
    """The shipped ``evaluate`` perplexity metric (loaded once, offline)."""
    import evaluate

    return evaluate.load(str(PERPLEXITY_METRIC))


def add_perplexity(ctx: BenchContext, records: list[dict], prompts: list[dict]) -> None:
    """Response perplexity under the base model (given the prompt), via the shipped metric."""
    metric = perplexity_metric()
    cache: dict[tuple, float | None] = {}
    for r in records:
        key = (r["prompt_index"], tuple(r["output_ids"]))
        if key not in cache:
            text = ctx.tokenizer.decode(r["output_ids"], skip_special_tokens=True)
            context = ctx.tokenizer.decode(prompts[r["prompt_index"]]["input_ids"])
            if not text.strip():
                cache[key] = None
            else:
                res = metric.compute(predictions=[text], contexts=[context], model=ctx.model,
                                     tokenizer=ctx.tokenizer, batch_size=1)  # fmt: skip
                cache[key] = res["perplexities"][0]
        r["perplexity"] = cache[key]


# ============================================================================ CLI
def set_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count (recorded in the result's environment)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _settings_from_args(args: argparse.Namespace) -> BenchSettings:
    preset = "quick" if args.quick else "standard" if args.standard else args.preset
    n, tokens = PRESETS[preset]
    if args.n is not None or args.max_new_tokens is not None:
        n, tokens = args.n or n, args.max_new_tokens or tokens
        named = [name for name, size in PRESETS.items() if size == (n, tokens)]
        preset = named[0] if named else f"custom ({n} prompts x {tokens} tokens)"
    mode = "typical" if args.typical else "sampling" if args.sampling else "greedy"
    return BenchSettings(
        tasks=tuple(args.tasks), num_prompts=n, max_new_tokens=tokens, preset=preset, mode=mode,
        methods=tuple(args.methods or ()), seed=args.seed, warmup_tokens=args.warmup_tokens,
        perplexity=not args.no_perplexity,
    )  # fmt: skip


def _bench(args: argparse.Namespace) -> int:
    from .report import write_report

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for module in args.plugin or ():
        importlib.import_module(module)
    settings = _settings_from_args(args)
    set_threads(args.threads)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/bench-{settings.mode}-{stamp}")
    heads = {"hydra": args.hydra_heads, "medusa": args.medusa_heads}
    t0 = time.perf_counter()
    ctx = load_context(args.model, heads=heads, random_missing=args.random_heads, bank=args.bank, device=args.device)
    ctx.eas_config = args.eas_config
    previous = read_results(out / "results.json") if args.resume and (out / "results.json").is_file() else None
    results = run_benchmark(ctx, settings, out_path=out / "results.json", resume=previous)
    results["environment"]["wall_time_s"] = time.perf_counter() - t0
    write_results(results, out / "results.json")
    paths = write_report(out / "results.json", out)
    print(Path(paths["table"]).read_text(encoding="utf-8"))
    if args.regime:
        from ..regime import analyse_results

        analyse_results(results, ctx, out)
    print(f"results: {out / 'results.json'}; wall time {time.perf_counter() - t0:.0f} s")
    return 0


def _bench_report(args: argparse.Namespace) -> int:
    from .report import write_report

    paths = write_report(args.results, args.out, results_md=args.results_md)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf bench`` and ``entmtp-hf bench-report``."""
    p = sub.add_parser(
        "bench",
        help="benchmark decoding methods on task baskets (tokens/s, speedup, accept length, ...)",
        description="Run every method interleaved on per-task prompt baskets; write results.json, "
        "a Table-1 style Markdown table and plots to --out.",
    )
    p.add_argument("--tasks", nargs="+", default=list(BUILTIN_TASKS), help="humaneval, gsm8k, chat, a JSONL file or a Hub dataset")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=f"preset quick: {PRESETS['quick'][0]} prompts x {PRESETS['quick'][1]} tokens")
    size.add_argument("--standard", action="store_true", help=f"preset standard: {PRESETS['standard'][0]} prompts x {PRESETS['standard'][1]} tokens")
    size.add_argument("--preset", choices=list(PRESETS), default="paper", help="basket preset (default: paper, 100 x 256)")
    p.add_argument("--n", type=int, default=None, help="prompts per task (overrides the preset)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (overrides the preset)")
    p.add_argument("--methods", nargs="+", default=None, help=f"subset of {list(METHODS)}")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sampling", action="store_true", help="T=0.7 sampling, exact (lossless) acceptance")
    mode.add_argument("--typical", action="store_true", help="T=0.7 sampling, typical acceptance (eps 0.09, alpha 0.3)")
    p.add_argument("--model", default=None, help="base model id or folder (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument("--hydra-heads", default=None, help=f"Hydra heads (default {DEFAULT_HEADS['hydra']})")
    p.add_argument("--medusa-heads", default=None, help=f"Medusa heads (default {DEFAULT_HEADS['medusa']})")
    p.add_argument("--random-heads", action="store_true", help="use random heads where trained ones are missing (smoke runs)")
    p.add_argument("--eas-config", default=None,
                   help="EAS settings (JSON) of the eas-calibrated method; {task} is replaced by the task")  # fmt: skip
    p.add_argument("--bank", default=None, help="tree bank folder (default: trees/smollm2-135m-cpu, else trees/published-defaults)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 is far faster on an oversubscribed CPU)")
    p.add_argument("--seed", type=int, default=123,
                   help="seed of the sampling draws (prompt i of every method: seed * 100003 + i); it does not "
                        "choose the prompts: --n takes the first N of each task's fixed evaluation pool")  # fmt: skip
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each method's warm-up generation")
    p.add_argument("--no-perplexity", action="store_true", help="skip the response perplexity")
    p.add_argument("--resume", action="store_true", help="keep the complete prompts of --out's results.json, run the rest")
    p.add_argument("--regime", action="store_true", help="also run the regime analysis on the EntMTP records")
    p.add_argument("--plugin", nargs="+", default=None, help="modules to import first (they may register methods)")
    p.add_argument("--out", default=None, help="output folder (default runs/bench-<mode>-<utc time>)")
    p.set_defaults(func=_bench)

    r = sub.add_parser("bench-report", help="tables and plots from a bench results.json",
                       description="Regenerate table.md and the PNG plots from RESULTS.json; given several "
                       "files (the same basket's tasks split over processes), merge them into --out/results.json "
                       "first.")  # fmt: skip
    r.add_argument("results", nargs="+", help="results.json written by entmtp-hf bench (one or more)")
    r.add_argument("--out", default=None, help="output folder (default: next to RESULTS; required to merge)")
    r.add_argument("--results-md", default=None, help="also write the docs/results.md page to this path")
    r.set_defaults(func=_bench_report)
