"""The benchmark's decoding methods: :class:`Method` objects in one registry, :data:`METHODS`.

Every method registers itself here with :func:`register_method`; a plug-in module does the
same (``entmtp-hf bench --plugin my.module``). A method whose heads, bank or library support
is missing is skipped with its reason. Most methods are opt-in (``default=False``): the
default list is the comparison a user runs first (plain decoding, prompt lookup, Hydra with
mc_sim_7b_63, EntMTP* and EntMTPτ); ``entmtp-hf bench --methods ...`` picks any others.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import CompileConfig

from ...config import EntMTPConfig
from ...cpu_kernels import onednn_linears, packed_linears
from ...decoding.stats import PhaseTimer
from ...scheduling.eas import EASConfig, fixed_length
from ...trees.tree import MC_SIM_7B_63, Tree
from .context import BenchContext
from .settings import MODES


@dataclass
class Generation:
    """What one generate call produced: the new token ids and EntMTP's statistics if any."""

    new_ids: list[int]
    stats: dict | None = None
    assisted: bool = False  # transformers' assisted decoding: its first forward verifies drafts too


#: ``(ctx, task, acceptance_kwargs)`` -> the EntMTP config of a tree method on that task
ConfigFactory = Callable[[BenchContext, str, dict], EntMTPConfig]
#: the timed callable a method prepares: ``run(input_ids, generate_kwargs)``
Run = Callable[[torch.Tensor, dict], Generation]


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
    default: bool = False  # part of the default method list
    #: the method whose greedy output this one must equal token for token (another dtype: its own plain run)
    reference: str = "vanilla"
    #: EntMTP calls on this machine's measured CPU kernels, as ``enable_entmtp``'s default runs them
    #: (False: ``F.linear`` throughout); plain methods never use them
    cpu_kernels: bool = True

    def unavailable(self, ctx: BenchContext, task: str, mode: str) -> str | None:
        """Why this method cannot run on ``task`` (None when it can)."""
        if self.heads is not None and self.heads not in ctx.heads:
            return ctx.missing_heads.get(self.heads, f"no {self.heads} heads")
        if self.entmtp is not None:
            try:
                config = self._config(ctx, task, mode)
                if config.guard:  # priced by the step costs prepare measures (calibrate): checked there
                    config = dataclasses.replace(config, guard=False)
                config.resolve(ctx.heads[self.heads].num_heads)
            except (ValueError, OSError) as e:
                return str(e)
        return None

    def model(self, ctx: BenchContext) -> Any:
        """The model this method decodes with: a divergence's logit gap is read from its logits."""
        return ctx.model

    def _config(self, ctx: BenchContext, task: str, mode: str) -> EntMTPConfig:
        key = (self.name, task, mode)
        if key not in ctx._configs:  # one config per (method, task): its plan is resolved once
            ctx._configs[key] = self.entmtp(ctx, task, dict(MODES[mode][1]))
        return ctx._configs[key]

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Run:
        """Set the model up for this method; returns ``run(input_ids, generate_kwargs)``."""
        kwargs = dict(self.generate_kwargs)
        if self.entmtp is not None:
            ctx.enable(self.heads, kernels=self.cpu_kernels)  # a heads swap, outside the clock
            kwargs["entmtp_config"] = self._config(ctx, task, mode)
            if kwargs["entmtp_config"].adapts:
                ctx.calibrated(ctx.model, ctx.heads[self.heads])
        return generate_runner(ctx, kwargs)


def generate_runner(ctx: BenchContext, kwargs: dict, model=None) -> Run:
    """The timed callable: ``generate`` (of ``model``, else the context's) with the method's
    ``kwargs`` on top of the basket's."""
    assisted = any(kwargs.get(k) is not None for k in ("assistant_model", "prompt_lookup_num_tokens"))
    model = model if model is not None else ctx.model

    def run(input_ids: torch.Tensor, gen_kwargs: dict) -> Generation:
        timer = PhaseTimer()
        observe = {"entmtp_observers": [timer]} if kwargs.get("entmtp_config") is not None else {}
        out = model.generate(input_ids, return_dict_in_generate=True, **gen_kwargs, **kwargs, **observe)
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
    from ...heads import HEADS_REGISTRY

    if method.heads is not None and method.heads not in HEADS_REGISTRY:
        raise ValueError(f"method {method.name!r}: unknown heads family {method.heads!r}")
    METHODS[method.name] = method
    return method


def default_method_names() -> tuple[str, ...]:
    return tuple(n for n, m in METHODS.items() if m.default)


def chosen_methods(names: Sequence[str] = ()) -> list[Method]:
    """The registered methods ``names`` (empty: the default list), in that order."""
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; registered: {list(METHODS)}")
    return [METHODS[n] for n in names or default_method_names()]


@dataclass(frozen=True)
class InDtype(Method):
    """The method run on a copy of the model and heads in another dtype (``BenchContext.in_dtype``),
    interleaved with the others; its greedy output is checked against plain decoding in that dtype."""

    dtype: torch.dtype = torch.bfloat16

    def model(self, ctx: BenchContext) -> Any:
        return ctx.in_dtype(self.dtype)[0]

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Run:
        model, heads = ctx.in_dtype(self.dtype)
        kwargs = dict(self.generate_kwargs)
        if self.entmtp is not None:
            ctx.enable(self.heads, model, heads[self.heads], kernels=self.cpu_kernels)
            kwargs["entmtp_config"] = self._config(ctx, task, mode)
            if kwargs["entmtp_config"].adapts:
                ctx.calibrated(model, heads[self.heads])
        return generate_runner(ctx, kwargs, model)


# ============================================================================ compiled decoding
#: the static cache's fixed length in the compiled methods: the basket's longest prompt and answer fit, so
#: one graph per tree size (and plain decoding's one) serves every prompt
COMPILED_CACHE_LEN = 2048


def compiled_kwargs(backend: str = "inductor", *, freezing: bool = False) -> dict[str, Any]:
    """``generate`` kwargs of the compiled methods: a static cache and transformers' own compile switch
    (``compile_config``; on a CPU it needs ``_compile_all_devices``, CUDA compiles by itself).
    ``freezing``: inductor's weight freezing (the weights become constants of the graph, prepacked
    for oneDNN on a CPU); torch takes either a mode or options, so it replaces the default mode."""
    options = {"mode": None, "options": {"freezing": True}} if freezing else {"mode": "default"}
    config = CompileConfig(fullgraph=False, dynamic=False, backend=backend, **options)
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config, "max_cache_len": COMPILED_CACHE_LEN}


def _compiled(method: Method) -> Method:
    """A compiled method, registered without the measured CPU kernels (whose dispatchers a graph
    would call), so it measures compilation alone."""
    return register_method(dataclasses.replace(method, cpu_kernels=False))


@dataclass(frozen=True)
class CompiledWith(Method):
    """A compiled method whose ``torch.compile`` backend comes from an extension module (imported
    before the first call: importing it registers the backend), skipped when it is not installed."""

    backend_module: str = ""

    def unavailable(self, ctx: BenchContext, task: str, mode: str) -> str | None:
        try:
            importlib.import_module(self.backend_module)
        except ImportError as e:
            return f"the {self.backend_module} backend is not installed ({e})"
        return super().unavailable(ctx, task, mode)


# ============================================================================ EntMTP configs
def _default_tree(ctx: BenchContext, task: str, acc: dict) -> EntMTPConfig:
    return EntMTPConfig(tree=MC_SIM_7B_63, **acc)


def _bank_policy(policy: str, family: str = "hydra", **extra: Any) -> ConfigFactory:
    def make(ctx: BenchContext, task: str, acc: dict) -> EntMTPConfig:
        bank = ctx.bank(task, family)
        return EntMTPConfig(bank=bank, task=bank.task, policy=policy, **acc, **extra)

    return make


def eas_bench_config(ctx: BenchContext, task: str, acceptance: dict, eas: EASConfig | None = None) -> EntMTPConfig:
    """Benchmark factory: the Hydra head chain as deep as the heads go, halted by EAS."""
    depth = ctx.heads["hydra"].num_heads
    return EntMTPConfig(tree=Tree.chain(depth).choices, eas=eas or EASConfig(), **acceptance)


def fixed_chain_config(k: int) -> ConfigFactory:
    """Benchmark factory: the fixed head chain of length ``k`` (unavailable with fewer heads)."""

    def make(ctx: BenchContext, task: str, acceptance: dict) -> EntMTPConfig:
        return EntMTPConfig(tree=Tree.chain(k).choices, **acceptance)

    return make


def calibrated_eas(ctx: BenchContext, task: str) -> EASConfig:
    """The ``--eas-config`` settings of ``task`` (``entmtp-hf eas-calibrate`` writes them)."""
    if ctx.eas_config is None:
        raise ValueError("eas-calibrated needs --eas-config (e.g. runs/eas-calibration-{task}/eas_config.json)")
    return EASConfig.from_json(ctx.eas_config.replace("{task}", Path(task).stem))


# ============================================================================ kernel methods
@dataclass(frozen=True)
class KernelReference(Method):
    """Plain ``generate`` with every linear layer of the model on oneDNN
    (:func:`~entmtp_hf.cpu_kernels.onednn_linears`): how much of a tree method's speed-up over
    vanilla the kernel alone would give plain decoding on this machine."""

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Run:
        run = generate_runner(ctx, dict(self.generate_kwargs))

        def timed(input_ids: torch.Tensor, gen_kwargs: dict) -> Generation:
            with onednn_linears(ctx.model):
                return run(input_ids, gen_kwargs)

        return timed


@dataclass(frozen=True)
class PackedWeights(Method):
    """The method run with the decoder's layers packed for oneDNN
    (:func:`~entmtp_hf.cpu_kernels.packed_linears`), packed before the clock starts and unpacked
    right after its timed call, as a model kept packed across many calls would run it."""

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Run:
        run = super().prepare(ctx, task, mode)
        if not ctx.hold(packed_linears(ctx.model)):
            raise RuntimeError(f"{self.name}: no layer of the model could be packed for oneDNN")
        return run


@dataclass(frozen=True)
class PackedKernelReference(PackedWeights, KernelReference):
    """Plain ``generate`` on the decoder's layers packed and the LM head (never packed) on oneDNN."""


@dataclass(frozen=True)
class MeasuredKernels(Method):
    """Plain ``generate`` on this machine's measured CPU kernels
    (:meth:`~entmtp_hf.cpu_kernels.CPUKernels.applied`, measured once per context): the fastest
    plain decoding the kernels give, the reference EntMTP on them is held against. Where they do
    not apply (another device or dtype, no oneDNN) it runs plain ``generate`` as it is."""

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Run:
        run = super().prepare(ctx, task, mode)
        kernels = ctx.hold(ctx.cpu_kernels())  # installed on the model's layers until release
        ctx.hold(kernels.applied())  # and applied in this thread, which times the call
        return run


# ============================================================================ draft-model methods
@dataclass(frozen=True)
class DraftMethod(Method):
    """Assisted decoding with the target's int8 copy as the draft model (``ctx.int8_draft()``)
    and EAS (or a fixed chain: :func:`~entmtp_hf.scheduling.eas.fixed_length`) deciding each
    chain's length."""

    eas: EASConfig = field(default_factory=EASConfig)

    def unavailable(self, ctx: BenchContext, task: str, mode: str) -> str | None:
        if ctx.device.type != "cpu":
            return "the int8 draft (dynamic quantisation) runs on the CPU only"
        return None if ctx.heads else "eas_config needs a model enabled by enable_entmtp, i.e. some heads"

    def prepare(self, ctx: BenchContext, task: str, mode: str) -> Run:
        from ...integration import EntMTPGenerationMixin, enable_entmtp

        if not isinstance(ctx.model, EntMTPGenerationMixin):  # the heads are not used, only the generate hook
            enable_entmtp(ctx.model, next(iter(ctx.heads.values())), cpu_kernels=False)
        return generate_runner(ctx, {"assistant_model": ctx.int8_draft(), "eas_config": self.eas})


# ============================================================================ the registry
register_method(Method("vanilla", "plain autoregressive generate", default=True))
register_method(KernelReference("vanilla-onednn", "plain generate, every linear layer on oneDNN (kernel reference)"))
register_method(
    PackedKernelReference(
        "vanilla-packed", "plain generate, the decoder's layers packed and the LM head on oneDNN (kernel reference)"
    )
)
register_method(MeasuredKernels("vanilla-kernels", "plain generate with this machine's measured CPU kernels"))
register_method(InDtype("vanilla-bf16", "plain generate on a bfloat16 copy of the model"))
register_method(
    InDtype(
        "entmtp-static-bf16",
        "EntMTP* on a bfloat16 copy of the model and heads",
        heads="hydra",
        entmtp=_bank_policy("static"),
        reference="vanilla-bf16",
    )
)
register_method(
    InDtype(
        "eagle-static-bf16",
        "EntMTP* with the EAGLE-style drafter and its bank on a bfloat16 copy of the model and drafter",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle"),
        reference="vanilla-bf16",
    )
)
_compiled(
    Method(
        "vanilla-compiled",
        "plain generate, static cache and the forward compiled (inductor)",
        generate_kwargs=compiled_kwargs(),
    )
)
_compiled(
    Method(
        "entmtp-static-compiled",
        "EntMTP*, static cache and the verification compiled (one graph per tree size)",
        heads="hydra",
        entmtp=_bank_policy("static"),
        generate_kwargs=compiled_kwargs(),
    )
)
_compiled(
    Method(
        "vanilla-compiled-frozen",
        "plain generate, static cache, the forward compiled by inductor with its weights frozen (prepacked for oneDNN)",
        generate_kwargs=compiled_kwargs(freezing=True),
    )
)
_compiled(
    Method(
        "eagle-static-compiled",
        "EntMTP* with the EAGLE-style drafter, static cache and the verification compiled (inductor)",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle"),
        generate_kwargs=compiled_kwargs(),
    )
)
_compiled(
    Method(
        "eagle-static-compiled-frozen",
        "EntMTP* with the EAGLE-style drafter, the verification compiled by inductor with frozen weights",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle"),
        generate_kwargs=compiled_kwargs(freezing=True),
    )
)
_compiled(
    CompiledWith(
        "vanilla-zentorch",
        "plain generate, static cache, the forward compiled by AMD's zentorch backend",
        generate_kwargs=compiled_kwargs("zentorch"),
        backend_module="zentorch",
    )
)
_compiled(
    CompiledWith(
        "eagle-static-zentorch",
        "EntMTP* with the EAGLE-style drafter, the verification compiled by AMD's zentorch backend",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle"),
        generate_kwargs=compiled_kwargs("zentorch"),
        backend_module="zentorch",
    )
)
register_method(
    Method(
        "pld", "prompt lookup decoding (transformers)", generate_kwargs={"prompt_lookup_num_tokens": 10}, default=True
    )
)
register_method(Method("medusa-default", "Medusa heads + mc_sim_7b_63", heads="medusa", entmtp=_default_tree))
register_method(
    Method("hydra-default", "Hydra heads + mc_sim_7b_63", heads="hydra", entmtp=_default_tree, default=True)
)
register_method(
    Method(
        "entmtp-static",
        "EntMTP*: the bank's static optimum for this machine (its frontier re-ranked "
        "by this machine's step costs where the bank carries one)",
        heads="hydra",
        entmtp=_bank_policy("static"),
        default=True,
    )
)
register_method(Method("eagle-default", "the EAGLE-style drafter + mc_sim_7b_63", heads="eagle", entmtp=_default_tree))
register_method(
    Method(
        "eagle-static",
        "EntMTP* with the EAGLE-style drafter and the bank searched with it",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle"),
    )
)
register_method(
    Method(
        "eagle-tau",
        "EntMTPτ (hysteresis) with the EAGLE-style drafter and its bank",
        heads="eagle",
        entmtp=_bank_policy("hysteresis", "eagle"),
    )
)
register_method(
    Method(
        "entmtp-static-stored",
        "EntMTP*: the tree the bank stores (chosen on the machine it was searched on), not re-ranked",
        heads="hydra",
        entmtp=_bank_policy("static", adapt=False),
    )
)
register_method(
    Method("entmtp-tau", "EntMTPτ: hysteresis T-/T+", heads="hydra", entmtp=_bank_policy("hysteresis"), default=True)
)
register_method(
    PackedWeights(
        "entmtp-static-packed",
        "EntMTP*, the decoder's layers packed for oneDNN",
        heads="hydra",
        entmtp=_bank_policy("static"),
        cpu_kernels=False,
    )
)
register_method(
    Method(
        "eagle-static-guard",
        "EntMTP* with the EAGLE-style drafter and its bank, and the break-even "
        "guard demanded (the root alone while a prompt's trees lose to plain steps)",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle", guard=True),
    )
)
register_method(
    Method(
        "eagle-static-no-guard",
        "EntMTP* with the EAGLE-style drafter and its bank, the break-even guard off",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle", guard=False),
    )
)
register_method(
    Method(
        "entmtp-static-mkl",
        "EntMTP* without the measured CPU kernels (cpu_kernels=False: F.linear throughout)",
        heads="hydra",
        entmtp=_bank_policy("static"),
        cpu_kernels=False,
    )
)
register_method(
    Method(
        "eagle-static-mkl",
        "EntMTP* with the EAGLE-style drafter and its bank, without the measured CPU kernels",
        heads="eagle",
        entmtp=_bank_policy("static", "eagle"),
        cpu_kernels=False,
    )
)
register_method(
    Method(
        "entmtp-value",
        "EntMTP-v: per step, the bank's value tree with the most path value",
        heads="hydra",
        entmtp=_bank_policy("value"),
    )
)
register_method(Method("entmtp-ladder", "EntMTP-l: threshold ladder", heads="hydra", entmtp=_bank_policy("ladder")))
register_method(
    Method(
        "entmtp-tau-retrieval",
        "EntMTPτ + a retrieval branch copied from earlier text",
        heads="hydra",
        entmtp=_bank_policy("hysteresis", retrieval=True),
    )
)
register_method(
    Method(
        "entmtp-tau-no-retrieval",
        "EntMTPτ without retrieval branches, whatever the bank's default",
        heads="hydra",
        entmtp=_bank_policy("hysteresis", retrieval=False),
    )
)
# Entropy-adaptive speculation (EAS) on the Hydra head chain and its fixed-chain baselines.
# Chains longer than the heads are skipped.
register_method(Method("eas", "EAS: Hydra head chain halted by entropy", heads="hydra", entmtp=eas_bench_config))
register_method(
    Method(
        "eas-w16",
        "EAS with a 16-token warm-up (the default waits 100 tokens)",
        heads="hydra",
        entmtp=lambda ctx, task, acc: eas_bench_config(ctx, task, acc, EASConfig(warmup_tokens=16)),
    )
)
register_method(
    Method(
        "eas-calibrated",
        "EAS with the task's calibrated settings (--eas-config)",
        heads="hydra",
        entmtp=lambda ctx, task, acc: eas_bench_config(ctx, task, acc, calibrated_eas(ctx, task)),
    )
)
for _k in (2, 4, 8, 12):  # short chains: verifying a few tokens costs about one forward where the cost is flat in N
    register_method(
        Method(f"chain-{_k}", f"fixed Hydra head chain, k={_k}", heads="hydra", entmtp=fixed_chain_config(_k))
    )
# The draft-model form of EAS against fixed chains, with the target's own int8 copy as the draft.
register_method(
    DraftMethod(
        "draft-eas",
        "int8 draft model, chain halted by EAS (k_max 12, 16-token warm-up)",
        eas=EASConfig(warmup_tokens=16),
    )
)
for _k in (4, 8, 12):
    register_method(DraftMethod(f"draft-chain-{_k}", f"int8 draft model, fixed chain k={_k}", eas=fixed_length(_k)))
