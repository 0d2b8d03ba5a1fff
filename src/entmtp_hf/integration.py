"""Tree speculative decoding inside ``model.generate``: enabling it on a model, and the hand-over.

:func:`enable_entmtp` re-classes a loaded decoder-only model as a subclass of
:class:`EntMTPGenerationMixin` and of its own class, with the draft heads as a submodule.
``model.generate(..., entmtp_config=EntMTPConfig(...))`` then runs all of transformers'
preparation (generation config, logits processors, stopping criteria, cache) and hands over
to :func:`~entmtp_hf.decoding.loop.entmtp_decode` through ``custom_generate``. Without
``entmtp_config`` the model generates exactly as before. ``generate(..., assistant_model=draft,
eas_config=EASConfig())`` instead runs transformers' assisted decoding with the entropy-adaptive
draft-model candidate generator (:mod:`entmtp_hf.assisted`). A ``custom_generate`` repo or
folder (``entmtp-hf export-generate``) receives the call with its EntMTP arguments unchanged.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import logging
import os
import sys
import threading
from contextvars import ContextVar
from typing import Any, Callable, Sequence

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import output_capturing

from .assisted import ACTIVE_EAS_CALL, EASCall, build_candidate_generator
from .banks.plan import DecodePlan
from .calibration import batch_bucket, tables_for
from .calibration import calibrate as calibrate_costs
from .config import EntMTPConfig
from .cpu_kernels import CPUKernels, applied_kernels, kernels_of
from .decoding.attention import restore_attention, use_tree_attention
from .decoding.compiled import compiled_call
from .decoding.loop import EntMTPGenerateOutput, entmtp_decode
from .decoding.options import check_generation_options, merged_generation_config
from .decoding.stats import DecodeObserver
from .errors import EntMTPError
from .heads import HEADS_ATTR, DraftHeads, load_heads
from .scheduling.eas import EASConfig

log = logging.getLogger(__name__)

#: the ``tokenizer=`` of the EntMTP call running in this context: transformers keeps a call's
#: tokenizer from the preparation of a ``custom_generate`` callable, so the mixin hands it to the
#: stop-string criterion (``_get_stopping_criteria``) as plain ``generate`` does
CALL_TOKENIZER: ContextVar[Any] = ContextVar("entmtp_call_tokenizer", default=None)


class EntMTPGenerationMixin:
    """Adds ``entmtp_config=`` and ``eas_config=`` to ``generate``. Mixed in ahead of the model's own class."""

    def generate(
        self,
        *args,
        entmtp_config: EntMTPConfig | None = None,
        eas_config: EASConfig | None = None,
        entmtp_observers: Sequence[DecodeObserver] = (),
        **kwargs,
    ):
        if isinstance(kwargs.get("custom_generate"), (str, os.PathLike)) and eas_config is None:
            # a repo's decoding method (such as the one `entmtp-hf export-generate` writes) gets the call as it is
            given = {"entmtp_config": entmtp_config, "entmtp_observers": tuple(entmtp_observers)}
            return super().generate(*args, **{k: v for k, v in given.items() if v}, **kwargs)
        if eas_config is not None:
            if entmtp_config is not None:
                raise EntMTPError(
                    "eas_config (draft-model EAS) and entmtp_config (draft heads) are exclusive; for "
                    "entropy-adaptive heads pass EntMTPConfig(tree=..., eas=EASConfig(...))"
                )
            return self._eas_generate(args, kwargs, eas_config)
        if entmtp_config is None:
            return super().generate(*args, **kwargs)
        if not isinstance(entmtp_config, EntMTPConfig):
            raise EntMTPError(f"entmtp_config must be an EntMTPConfig, got {type(entmtp_config).__name__}")
        if kwargs.get("custom_generate") is not None:
            raise EntMTPError("entmtp_config cannot be combined with a custom_generate callable")
        heads = getattr(self, HEADS_ATTR, None)
        if heads is None:
            raise EntMTPError("this model has no draft heads: call enable_entmtp(model, heads) first")
        check_supported_call(self, args, kwargs)
        batch_size = _batch_size(self, args, kwargs)
        plan_for = _plans_by_batch_size(self, heads, entmtp_config, batch_size)  # before the prefill
        plan = plan_for(batch_size)
        with applied_kernels(self):
            if entmtp_config.adapts and plan.plain:  # this machine's ranking: nothing beats plain decoding here
                return _as_entmtp_output(super().generate(*args, **kwargs), args, kwargs)
            loop = functools.partial(
                entmtp_decode,
                plan=plan,
                heads=heads,
                streamer=kwargs.get("streamer"),
                observers=tuple(entmtp_observers),
                plan_for=plan_for,
            )
            token = CALL_TOKENIZER.set(kwargs.get("tokenizer"))
            try:
                return super().generate(*args, custom_generate=loop, **kwargs)
            finally:
                CALL_TOKENIZER.reset(token)

    def _eas_generate(self, args: tuple, kwargs: dict, eas_config: EASConfig):
        """Assisted generation with the EAS candidate generator (see :mod:`entmtp_hf.assisted`)."""
        if not isinstance(eas_config, EASConfig):
            raise EntMTPError(f"eas_config must be an EASConfig, got {type(eas_config).__name__}")
        if kwargs.get("assistant_model") is None:
            raise EntMTPError("eas_config drafts with a draft model: pass assistant_model=<draft model>")
        for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer", "custom_generate"):
            if kwargs.get(name) is not None:
                raise EntMTPError(f"eas_config cannot be combined with {name}")
        check_supported_call(self, args, kwargs, allowed=("assistant_model",))
        call = EASCall(model=self, config=eas_config)
        token = ACTIVE_EAS_CALL.set(call)
        try:
            out = super().generate(*args, **kwargs)
        finally:
            ACTIVE_EAS_CALL.reset(token)
        if call.generator is None:
            raise RuntimeError("generate did not run assisted decoding, so EAS was not used; check the call's options")
        if isinstance(out, GenerateDecoderOnlyOutput):
            fields = {k: v for k, v in out.items() if k != "entmtp_stats"}
            return EntMTPGenerateOutput(**fields, entmtp_stats={"eas": call.generator.controller.stats.as_dict()})
        return out

    def _get_stopping_criteria(self, *args, **kwargs):
        """transformers' stopping criteria, with the EntMTP call's tokenizer for ``stop_strings``
        (:data:`CALL_TOKENIZER`), from whichever generation config set them."""
        args, kwargs = _with_call_tokenizer(super()._get_stopping_criteria, args, kwargs)
        return super()._get_stopping_criteria(*args, **kwargs)

    def _get_candidate_generator(self, *args, **kwargs):
        """transformers' hook for assisted decoding: the EAS generator while an EAS call runs on this model."""
        call = ACTIVE_EAS_CALL.get()
        if call is None or call.model is not self:
            return super()._get_candidate_generator(*args, **kwargs)
        bound = inspect.signature(super()._get_candidate_generator).bind(*args, **kwargs)
        return build_candidate_generator(call, bound.arguments)

    def get_compiled_call(self, compile_config):
        """transformers' compiled forward, compiled as :func:`~entmtp_hf.decoding.compiled.compiled_call`
        does (static shapes; on a CPU its default inductor options where the config sets none):
        plain ``generate`` and EntMTP's verification share its graphs."""
        return compiled_call(self, compile_config)

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save(model)``) and deep-copied as the model's own class, made EntMTP's
        again on load: the class :func:`enable_entmtp` makes carries the model class's name, under
        which pickle finds the model class itself and refuses."""
        _drop_output_capturing_hooks(self)
        fn, args, *rest = super().__reduce_ex__(protocol)
        cls = type(self)
        base = _model_class(cls)
        if not args or args[0] is not cls or _entmtp_class(base) is not cls:  # a class of the user's own
            return (fn, args, *rest)
        if fn is copyreg.__newobj__:
            return (_new_enabled, (base, *args[1:]), *rest)
        return (_new_enabled, (base,), *rest)  # protocols 0 and 1: copyreg._reconstructor(cls, object, None)


def _with_call_tokenizer(method: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of ``method(*args, **kwargs)`` with ``tokenizer`` set to the EntMTP call's
    (:data:`CALL_TOKENIZER`) where transformers passes none."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    if bound.arguments.get("tokenizer") is None and CALL_TOKENIZER.get() is not None:
        bound.arguments["tokenizer"] = CALL_TOKENIZER.get()
    return bound.args, bound.kwargs


def _prompt(args: tuple, kwargs: dict) -> Any:
    """The prompt of a ``generate`` call: positional, ``inputs=`` or ``input_ids=`` (a ``custom_generate``
    hand-over passes ``inputs=None`` beside ``input_ids``)."""
    if args:
        return args[0]
    return kwargs["inputs"] if kwargs.get("inputs") is not None else kwargs.get("input_ids")


def _copies(model, kwargs: dict) -> int:
    """Sequences per prompt: ``num_return_sequences`` of the merged generation config (the call's,
    its ``generation_config``'s or the model's, as plain ``generate`` reads it)."""
    return int(merged_generation_config(model, kwargs).num_return_sequences or 1)


def _batch_size(model, args: tuple, kwargs: dict) -> int:
    """Rows the call decodes: prompts times sequences per prompt (transformers expands them first)."""
    prompt = _prompt(args, kwargs)
    prompts = int(prompt.shape[0]) if isinstance(prompt, torch.Tensor) and prompt.ndim == 2 else 1
    return prompts * _copies(model, kwargs)


def _plans_by_batch_size(model, heads, config: EntMTPConfig, batch_size: int) -> Callable[[int], DecodePlan]:
    """The plan for every live batch size up to ``batch_size``. A bank that adapts ranks its frontier
    with this machine's measured step costs at each size's bucket
    (:func:`~entmtp_hf.calibration.batch_bucket`): the bank's entry for the machine, else the cache,
    else the nearest measured size's, else (never measured) the bank's stored choice. Nothing is
    measured here (:func:`~entmtp_hf.calibration.calibrate` is where that happens)."""
    rows = heads.config.draft_vocab_rows
    if not config.adapts:
        plan = config.resolve(heads.num_heads, rows)
        return lambda b: plan
    buckets = {batch_bucket(b) for b in range(1, batch_size + 1)}
    tables = tables_for(model, heads, buckets, known=config.load_bank().machine_tables())
    plans = {k: config.resolve(heads.num_heads, rows, table) for k, table in tables.items()}
    return lambda b: plans[batch_bucket(b)]


def _as_entmtp_output(out, args: tuple, kwargs: dict):
    """Plain decoding's output with the statistics an EntMTP call returns (one token per step)."""
    if not isinstance(out, GenerateDecoderOnlyOutput):
        return out
    prompt = _prompt(args, kwargs)
    steps = out.sequences.shape[1] - prompt.shape[1] - 1
    stats = {
        "plain_decoding": True,
        "accept_lengths": [1] * steps,
        "tree_indices": [0] * steps,
        "tree_sizes": [1] * steps,
        "features": [None] * steps,
        "steps": steps,
        "new_tokens": steps + 1,
        "mean_accept_length": 1.0 if steps else 0.0,
        "drafted_tokens": 0,
        "accepted_draft_tokens": 0,
    }
    return EntMTPGenerateOutput(**dict(out.items()), entmtp_stats=stats)


def check_supported_call(model, args: tuple, kwargs: dict, *, allowed: tuple[str, ...] = ()) -> None:
    """Refuse, before any compute, what tree decoding does not support: the inputs, and every
    generate option the table of :mod:`~entmtp_hf.decoding.options` refuses, whether passed or set
    in a generation config (``allowed``: arguments the caller handles itself)."""
    inputs = _prompt(args, kwargs)
    if kwargs.get("inputs_embeds") is not None:
        raise EntMTPError("EntMTP decoding needs input_ids, not inputs_embeds")
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 and inputs.shape[0] * _copies(model, kwargs) > 1:
        _check_batch(inputs, kwargs)
    check_generation_options(model, kwargs, allowed=allowed)


def _check_batch(inputs: torch.Tensor, kwargs: dict) -> None:
    """A batch is left-padded (decoder-only batches are, in transformers)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if tuple(mask.shape) != tuple(inputs.shape):
            raise EntMTPError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(inputs.shape)}")
        padded_right = (mask[:, -1] == 0) & (mask != 0).any(
            dim=-1
        )  # a row of padding alone decodes as in plain generate
        if bool(padded_right.any()):
            raise EntMTPError(
                "EntMTP decodes a batch of left-padded prompts; this attention_mask pads on the right "
                "(set tokenizer.padding_side = 'left')"
            )


def _drop_output_capturing_hooks(model: torch.nn.Module) -> None:
    """Take off the forward hooks transformers installs the first time a forward records hidden
    states (every EntMTP call does), and its mark that they are installed: they are closures, which
    pickle cannot store, and transformers installs them again at the next forward that records (so
    a model is pickled or copied while no other thread runs it, as any module's state is read)."""
    with getattr(output_capturing, "_hook_installation_lock", threading.Lock()):
        for module in model.modules():
            for key, hook in list(module._forward_hooks.items()):
                if getattr(hook, "__module__", None) == output_capturing.__name__ and "<locals>" in hook.__qualname__:
                    del module._forward_hooks[key]
            vars(module).pop("_output_capturing_hooks_installed", None)


def _model_class(cls: type) -> type:
    """The model's own class under the EntMTP subclass ``cls``."""
    return next(c for c in cls.__mro__[1:] if not issubclass(c, EntMTPGenerationMixin))


def _new_enabled(base: type, *args: Any) -> Any:
    """An empty instance of ``base``'s EntMTP subclass (unpickling fills it)."""
    cls = _entmtp_class(base)
    return cls.__new__(cls, *args)


@functools.lru_cache(maxsize=None)
def _entmtp_class(cls: type) -> type:
    """The subclass of ``cls`` with EntMTP generation (one per model class).

    It keeps the class's name, so code that checks model types by name (``pipeline``'s
    supported-model check) still recognises the model; ``isinstance(model,
    EntMTPGenerationMixin)`` tells an enabled model apart.
    """
    return type(
        cls.__name__, (EntMTPGenerationMixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )


def enable_entmtp(
    model,
    heads: "DraftHeads | str | os.PathLike",
    *,
    revision: str | None = None,
    calibrate: bool | Sequence[int] = False,
    cpu_kernels: bool | CPUKernels = True,
    **kernel_options: Any,
) -> Any:
    """Attach draft heads to ``model`` and give its ``generate`` the ``entmtp_config`` option.

    ``heads`` is a heads object, a local folder or a Hub repo id (``revision`` pins a Hub
    revision), in this project's format or the published Hydra / Medusa ones, or ``"mtp"``: the
    model's own multi-token-prediction layers, loaded from its checkpoint as transformers loads
    them for ``use_mtp=True`` (:class:`~entmtp_hf.heads.mtp.MtpHeads`); they are checked
    against the model (vocabulary, hidden size) and moved to its LM head's device and dtype.
    ``calibrate``: measure this machine's step costs now (``True``: at batch size 1; a list: at
    those batch sizes), which a bank with an acceptance frontier re-ranks its trees by; seconds
    per batch size with a progress bar, cached (:func:`~entmtp_hf.calibration.calibrate`; read
    from the cache when measured before). ``generate`` never measures.
    ``cpu_kernels`` (on a CPU model in float32 or bfloat16): measure which product is fastest at
    each row count on this machine (a few seconds now, logged; ``kernel_options`` go to
    :class:`~entmtp_hf.cpu_kernels.CPUKernels`) and run this model's EntMTP calls on them; the
    model's weights and its plain ``generate`` stay as they are. ``False``: ``F.linear``
    throughout; a :class:`~entmtp_hf.cpu_kernels.CPUKernels` measured before for this model: those.
    Returns the same model object; calling it again replaces the heads (and the kernels).
    """
    if getattr(model.config, "is_encoder_decoder", False):
        raise EntMTPError("EntMTP supports decoder-only models; this model is an encoder-decoder")
    lm_head = model.get_output_embeddings()
    if lm_head is None or not isinstance(getattr(lm_head, "weight", None), torch.Tensor):
        raise EntMTPError(f"{type(model).__name__} has no output embeddings (LM head) to verify with")
    heads = load_heads(heads, revision, model=model, base_config=model.config)
    heads.check_fits(model)
    heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    heads.eval()
    _remove_kernels(model)
    if not isinstance(model, EntMTPGenerationMixin):
        model.__class__ = _entmtp_class(type(model))
        use_tree_attention(model)
    setattr(model, HEADS_ATTR, heads)
    if cpu_kernels is not False:
        _install_kernels(model, heads, cpu_kernels, kernel_options)
    if calibrate is True or (calibrate is not False and calibrate is not None):
        calibrate_costs(model, heads, batch_sizes=(1,) if calibrate is True else calibrate)
    return model


def _install_kernels(model, heads: DraftHeads, kernels: bool | CPUKernels, options: dict) -> None:
    if isinstance(kernels, CPUKernels):
        if kernels.model is not model or kernels.heads not in (None, heads):
            raise EntMTPError("cpu_kernels: these CPUKernels were measured for another model or other heads")
    elif kernels is True:
        kernels = CPUKernels(model, heads, **options)
        if kernels.active:  # a few seconds the user waited for: said whatever logging's level
            message = (
                f"entmtp-hf: measured this machine's CPU kernels: {kernels.describe()}; EntMTP calls run on "
                "them (enable_entmtp(..., cpu_kernels=False): F.linear throughout)"
            )
            print(message, file=sys.stderr)
            log.info(message)
    else:
        raise EntMTPError(f"cpu_kernels must be True, False or a CPUKernels, got {kernels!r}")
    kernels.install()


def _remove_kernels(model) -> None:
    kernels = kernels_of(model)
    if kernels is not None:
        kernels.remove()


def disable_entmtp(model) -> Any:
    """Undo :func:`enable_entmtp`: drop the heads and the CPU kernels, restore the model's class."""
    if isinstance(model, EntMTPGenerationMixin):
        _remove_kernels(model)
        delattr(model, HEADS_ATTR)
        restore_attention(model)
        model.__class__ = _model_class(type(model))
    return model
