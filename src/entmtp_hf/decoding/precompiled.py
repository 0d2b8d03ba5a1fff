"""Compiled forwards saved whole, so that a second process loads a graph in about a second.

inductor's on-disk caches spare a second process the code generation, not the rest: dynamo traces
the model's Python again and AOTAutograd rebuilds the graph, ~9-13 s per graph for the demo model
on two cores, once per tree size an EntMTP call verifies. torch's ahead-of-time precompilation
(``torch.compile(fn).aot_compile``, loaded by ``torch.compiler.load_compiled_function``) saves the
traced bytecode and the compiled graph together; loading skips both.

What a saved graph may be reused for is this package's :func:`artifact_key`, not dynamo's guards:
the graph keeps only its tensor and global-state guards (``keep_portable_guards_unsafe``; its other
guards name transformers' local classes, which cannot be saved), so everything else a graph is
specialised to is in the key: the call's non-tensor arguments, the cache's type and length, the
model's module tree (each module's name and class and any instance ``forward`` with what it traces as,
each parameter's and buffer's name, shape and dtype: a module swapped in with the same weights, or
adapters added, would otherwise load the graph traced without them), its attention
implementation and training mode, the compile options, and the versions of Python, torch and
transformers; a loaded graph is used only while the source of every function it traced
(transformers' modelling code, this package's attention) reads as it did. The folder
(:func:`~entmtp_hf.decoding.compiled.compile_folder`) already separates machines, models, dtypes
and quantizations. Only graphs whose weights stay inputs are saved: a ``freezing`` compile folds
the weights into the graph, and a key cannot tell two checkpoints of one architecture apart; and
only those whose weights are plain tensors (:func:`plain_weights`; an int8 model's graphs read
its layers' int8 values and scales as plain tensors where the CPU kernels route them).

The files are pickles written by this package into the user's own cache folder, trusted as
inductor trusts its caches there; a path from elsewhere is never loaded. A file that fails to load,
or whose graph refuses a call, is removed and compiled again.
"""

from __future__ import annotations

import collections  # noqa: F401  (a saved graph's bytecode loads this module as a global of _forward's module)
import hashlib
import importlib
import inspect
import os
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import transformers

from ..cpu_kernels import held_weights
from ..heads import HEADS_ATTR
from .attention import graph_attention

#: suffix of a saved compiled forward in its compile folder's ``precompiled`` subfolder
SUFFIX = ".aot"


class Refused(RuntimeError):
    """A saved graph's guards refused a call: a tensor with a layout, dtype or grad flag it was not
    compiled for (the caller runs that call through dynamo, which compiles what it needs)."""


def _as_forward(fn, model) -> Callable[..., Any]:
    """The saved or loaded graph ``fn`` as a forward of ``model`` taking ``model(**kwargs)``'s keywords."""

    def forward(**kwargs: Any) -> Any:
        try:
            return fn(model, **kwargs)
        except RuntimeError as err:  # checked before the graph runs: nothing was computed or written
            if "GuardManager check failed" in str(err):
                raise Refused(str(err)) from None
            raise

    return forward


def _forward(model, **kwargs: Any) -> Any:
    """The function compiled and saved: a module-level function (a bound ``forward`` of a transformers
    model is wrapped by decorators, which a saved graph cannot name)."""
    return model(**kwargs)


def saves_graphs(kwargs: dict[str, Any]) -> bool:
    """Whether a compile with these ``torch.compile`` keywords can be saved: inductor, static shapes,
    options rather than a mode (the saved graph's guard filter is an option) and the weights left as
    inputs. It is compiled as one graph (precompilation's condition) whatever ``fullgraph`` says: a
    forward that breaks into several is compiled the usual way (:func:`compile_and_save`)."""
    options = kwargs.get("options") or {}
    return (
        kwargs.get("backend") == "inductor"
        and kwargs.get("dynamic") is False
        and kwargs.get("mode") is None
        and not options.get("freezing")
        and hasattr(torch.compiler, "load_compiled_function")
    )


def plain_weights(model) -> bool:
    """Whether every weight a graph of ``model`` reads is a plain tensor: every parameter is one, or is
    an int8 weight that the graph reads as the values and scales its layer's CPU kernel holds
    (:func:`~entmtp_hf.cpu_kernels.held_weights`). Saving a graph pickles its guards, which builds an
    empty copy of each weight they reach; torchao's quantized weights (``Int8Tensor``) implement no
    ``empty_like``, so a graph reaching one would be compiled for nothing before the save failed (and
    compiled again the usual way): such models are compiled the usual way at once."""
    held = held_weights(model)
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) or id(p) in held for p in model.parameters())


def artifact_key(model, shape_key: tuple, kwargs: dict[str, Any]) -> str:
    """The file name of the graph for a call of ``shape_key`` (:func:`~entmtp_hf.decoding.compiled._shape_key`)
    compiled with ``kwargs`` on ``model``: everything a saved graph is specialised to besides its
    tensors' shapes, which its own guards check."""
    parts = (
        shape_key,
        sorted(kwargs.items(), key=lambda kv: kv[0]),
        _structure(model, _rows(shape_key)),
        getattr(model.config, "_attn_implementation", None),
        graph_attention() if next(model.parameters()).device.type == "cpu" else "sdpa",
        model.training,
        sys.version_info[:3],
        torch.__version__,
        transformers.__version__,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24] + SUFFIX


def _rows(shape_key: tuple) -> int:
    """The rows a forward of ``shape_key`` multiplies: batch x tokens of its ids or embeddings, wherever
    the key nests them (0 if it has neither)."""
    for part in shape_key:
        if not isinstance(part, tuple):
            continue
        if len(part) == 3 and part[0] in ("input_ids", "inputs_embeds") and isinstance(part[1], tuple):
            return part[1][0] * part[1][1] if len(part[1]) >= 2 else 0
        rows = _rows(part)
        if rows:
            return rows
    return 0


def _structure(model, rows: int) -> str:
    """A digest of ``model``'s module tree (its draft heads left out: the forward never runs them, so
    every drafter shares the base model's graphs), with what each routed layer traces as at ``rows``
    rows: what a saved graph traced through and its guards do not check."""
    digest, heads = hashlib.sha256(), f"{HEADS_ATTR}."
    for name, module in model.named_modules():
        if name != HEADS_ATTR and not name.startswith(heads):
            digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__};".encode())
            routed = vars(module).get("forward")  # an instance forward: the CPU kernels' dispatcher, say
            if routed is not None:
                traced = routed.graph_kernel(rows) if hasattr(routed, "graph_kernel") else ""
                digest.update(f"{type(routed).__qualname__}:{traced};".encode())
    for kind, tensors in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in tensors:
            if not name.startswith(heads):
                digest.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return digest.hexdigest()


def load(path: Path, model) -> Callable[..., Any] | None:
    """The saved graph at ``path`` as a forward of ``model`` (keywords as ``model(**kwargs)``); None
    when there is none, or it cannot be loaded on this machine (then the file is removed)."""
    if not path.is_file():
        return None
    try:
        with path.open("rb") as fh:
            fn = torch.compiler.load_compiled_function(fh, f_globals=_forward.__globals__)
    except Exception as err:  # a file from another build or a torn write: compile again
        warnings.warn(f"entmtp-hf: could not load the compiled forward {path} ({err}); compiling it again")
        path.unlink(missing_ok=True)
        return None
    if not _sources_unchanged(fn):
        path.unlink(missing_ok=True)
        return None
    return _as_forward(fn, model)


def _sources_unchanged(fn) -> bool:
    """Whether every function the saved graph traced has the source it had then (its lines hashed as
    torch's precompilation hashed them when it saved the graph)."""
    for code in fn.source_info().inlined_sources:
        try:
            lines = inspect.getsourcelines(importlib.import_module(code.module))[0]
        except (ImportError, OSError, TypeError):
            return False
        source = "".join(lines[code.firstlineno - 1 : code.lastlineno - 1])
        if hashlib.sha256(source.encode()).hexdigest() != code.checksum:
            return False
    return True


@contextmanager
def _kept(model) -> Iterator[None]:
    """Puts back any forward hook or attribute the block takes off ``model``'s modules. Saving a graph's
    guards pickles the model, and pickling an EntMTP model takes off transformers' output-capturing
    hooks and their mark (closures, which pickle cannot store; see ``entmtp_hf.integration``):
    without them the next trace would meet transformers installing them under a lock, which
    dynamo cannot trace. The block runs without what the guards' pickler cannot store and no forward
    reads: the per-module ``extra_repr`` that torchao's ``quantize_`` sets (a method of a
    ``functools.partial``; only ``repr`` reads it), and the weights' ``.grad`` left by training (the
    pickler stores a weight's gradient only as a placeholder, which the load then refuses)."""
    before = [(m, dict(m._forward_hooks), dict(vars(m))) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    for module in model.modules():
        vars(module).pop("extra_repr", None)
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in grads:
            p.grad = grad
        for module, hooks, attrs in before:
            for key, hook in hooks.items():
                module._forward_hooks.setdefault(key, hook)
            for name, value in attrs.items():
                vars(module).setdefault(name, value)


def compile_and_save(path: Path, model, compile_kwargs: dict[str, Any], example: dict[str, Any]) -> Callable | None:
    """Compile ``model``'s forward as one graph for calls shaped like ``example`` (not run) and save
    it at ``path`` (written to a temporary file first, so a concurrent process never reads half a
    graph). None where the forward does not trace as one graph: the caller compiles it the usual way."""
    options = dict(compile_kwargs.get("options") or {})
    options["guard_filter_fn"] = torch.compiler.keep_portable_guards_unsafe
    compiled = torch.compile(_forward, **{**compile_kwargs, "fullgraph": True, "options": options})
    try:
        with _kept(model):
            fn = compiled.aot_compile(((model,), example))
    except Exception as err:  # a graph break (or a precompilation limit): not saveable
        warnings.warn(
            f"entmtp-hf: this forward cannot be saved as one compiled graph ({type(err).__name__}); "
            "a later process compiles it again"
        )
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        pass
    try:
        fn.save_compiled_function(tmp.name)
        os.replace(tmp.name, path)
    except Exception as err:  # the graph still serves this process
        Path(tmp.name).unlink(missing_ok=True)
        warnings.warn(f"entmtp-hf: could not save the compiled forward to {path} ({err}); the next process compiles it")
    return _as_forward(fn, model)
