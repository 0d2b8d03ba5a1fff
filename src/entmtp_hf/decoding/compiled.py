"""Compiled decoding: the model's forward compiled once per static shape, for plain and EntMTP decoding alike.

transformers compiles the decode forward when the cache is static and the device (or
``compile_config._compile_all_devices``) allows it: ``model.get_compiled_call(compile_config)``
is ``torch.compile(model.__call__, **compile_config.to_dict())``. On a CPU that route ran slower
than eager, for reasons of the route, not of inductor (docs/performance.md, "Compiled decoding"):

* a compiled step attends over every slot of the static cache, filled or not, and ``generate``
  sizes that cache to the longest call so far (or ``max_cache_len``): at 2048 slots for ~300
  filled, a compiled forward cost more than an eager one;
* transformers' ``sdpa`` regroups a single query's heads onto the grouped key/value heads only
  outside compiled code, so a compiled step copies every layer's keys and values once per query
  head (``repeat_kv``), over the whole static cache;
* ``CompileConfig()``'s defaults target CUDA: ``mode="reduce-overhead"`` (CUDA graphs) does
  nothing on a CPU, ``dynamic=None`` makes the cache length symbolic once it changes, and no
  inductor option is set.

:func:`compile_kwargs` keeps what the user's ``CompileConfig`` says and fills in what it leaves
at transformers' defaults: static shapes and, on a CPU, :func:`default_options`. The EntMTP
attention (:func:`~entmtp_hf.decoding.attention.grouped_tree_attention`) keeps the heads grouped
in every compiled CPU forward. :func:`compiled_call` compiles once per model and config; the
EntMTP mixin's ``get_compiled_call`` returns it, so plain ``generate`` (the honest baseline) and
EntMTP's verification (:func:`~entmtp_hf.decoding.loop.open_session`) share one compiled forward.
Each new shape is announced and timed; inductor's on-disk caches live in a folder per machine,
model and precision under the user cache folder, and an unfrozen graph is saved whole there
(:mod:`~entmtp_hf.decoding.precompiled`), so a second process loads it in about a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm
from transformers import CompileConfig

from ..costs.fingerprint import machine_fingerprint, quantization_of
from ..cpu_kernels import hold_current, kernel_routing
from ..errors import EntMTPError
from ..paths import cache_dir
from . import precompiled
from .product_groups import ProductGroups


def default_options(device: torch.device, dtype: torch.dtype, *, routed: bool = False) -> dict[str, Any] | None:
    """inductor options where the user's config sets none (None: transformers' mode stays). On a CPU a
    float32 model compiles without ``freezing``: on the demo model a frozen forward was no faster
    (33.2 against 32.8 ms) and cost twice the first compile (72 against 36 s) and more than twice a
    second process's (21 against 9 s: freezing compiles past inductor's AOTAutograd cache). Other
    dtypes freeze (the weights folded into the graph, prepacked for oneDNN's bf16 and int8 kernels)
    unless ``routed``: the model's products run the CPU kernels' graph operator, which finds its
    layer by the weight it is given and so needs the weights as graph inputs (a bfloat16 forward of
    the demo model on a Zen 2 EPYC: see docs/performance.md). ``cpp_wrapper`` (the graph's kernels
    called from C++) is left to the user: 7% per forward there, two minutes of C++ compilation per
    graph on two cores. Every CPU graph skips inductor's per-call size and stride checks (its Python
    wrapper checked every input and operator output per call: 818 checks of ~0.8 us in an int8
    forward of the demo model, 1.1 ms of 11.9; dynamo's guards check the inputs already, and the
    package's operators declare their outputs' layout); a routed model's graphs also group a layer's
    int8 products of one input (:mod:`~entmtp_hf.decoding.product_groups`)."""
    if device.type != "cpu":
        return None
    options: dict[str, Any] = {"size_asserts": False}
    if routed:  # a layer's int8 products of one input in one call (product_groups)
        options["post_grad_custom_post_pass"] = ProductGroups()
    return options if dtype == torch.float32 or routed else {"freezing": True, **options}


#: attribute of a model that holds its compiled forwards, by their ``torch.compile`` keywords
_COMPILED_ATTR = "_entmtp_compiled_calls"


def compile_kwargs(
    config: CompileConfig | None, device: torch.device, dtype: torch.dtype = torch.float32, *, routed: bool = False
) -> dict[str, Any]:
    """``torch.compile`` keywords for ``config`` on ``device`` (a model in ``dtype``, its products
    ``routed`` through the CPU kernels or not): its backend, ``fullgraph``, and its ``dynamic``,
    ``mode`` and ``options`` where it changed transformers' defaults; else static shapes
    (``dynamic=False``) and, where :func:`default_options` has some, those options (torch takes a
    mode or options, not both) in place of the CUDA-graph mode."""
    config = config or CompileConfig()
    default = CompileConfig()
    kwargs = {"backend": config.backend, "fullgraph": config.fullgraph}
    kwargs["dynamic"] = False if config.dynamic is None else config.dynamic
    options = default_options(device, dtype, routed=routed)
    if config.options is not None:
        kwargs |= {"mode": None, "options": dict(config.options)}
    elif config.mode == default.mode and options is not None and config.backend == "inductor":
        kwargs |= {"mode": None, "options": options}
    else:
        kwargs["mode"] = config.mode
    return kwargs


def compile_folder(model) -> Path:
    """Inductor's cache folder for ``model`` on this machine: one per processor (and threads,
    dtype, torch build), model architecture and size, and quantization."""
    device = next(model.parameters()).device
    machine = machine_fingerprint(device, model.dtype).key()
    config = model.config.get_text_config().to_diff_dict()
    config.pop("_name_or_path", None)  # where it was loaded from does not change a graph
    model_side = {"config": config, "quantization": quantization_of(model)}
    digest = hashlib.sha256(json.dumps(model_side, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "compiled" / f"{machine}-{digest}"


@contextmanager
def inductor_cache(folder: Path) -> Iterator[Path]:
    """Inductor's on-disk caches in ``folder`` for the block, unless the user pointed
    ``TORCHINDUCTOR_CACHE_DIR`` elsewhere than inductor's default (which inductor itself writes
    into the variable once it ran); yields the folder in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        yield Path(chosen)
        return
    folder.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(folder)):
        yield folder


def _shape_key(kwargs: dict[str, Any]) -> tuple:
    """What a static-shape graph is specialised to: every tensor's shape and dtype, every other
    argument's value, the cache's type and length, and whether autograd records (and inference
    mode, whose tensors a graph traced outside it does not take)."""
    key: list = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for name, value in sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            key.append((name, tuple(value.shape), str(value.dtype)))
        elif isinstance(value, dict):
            key.append((name, _shape_key(value)))
        elif hasattr(value, "get_max_length"):  # a cache
            key.append((name, type(value).__name__, int(value.get_max_length())))
        else:
            key.append((name, repr(value)))
    return tuple(key)


def _describe(kwargs: dict[str, Any]) -> str:
    ids = kwargs.get("input_ids")
    cache = kwargs.get("cache")
    what = f"{ids.shape[0]} row(s) x {ids.shape[1]} token(s)" if isinstance(ids, torch.Tensor) else "a new shape"
    if cache is not None and hasattr(cache, "get_max_length"):
        what += f", {int(cache.get_max_length())} cache slots"
    return what


@contextmanager
def _ticking(desc: str) -> Iterator[None]:
    """A bar counting the seconds of a blocking call (on a terminal; redrawn from a thread, since the
    call itself reports nothing)."""
    with tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr, disable=None) as bar:
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(1.0):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            bar.update(1)


def _not_compiled() -> None:
    """What a copied or unpickled :class:`CompiledForward` becomes: :func:`compiled_call` compiles anew."""
    return None


class CompiledForward:
    """``model``'s forward compiled with ``torch.compile`` keywords ``kwargs``; the first call of each
    new shape compiles (announced, timed in :attr:`compile_seconds`) in :func:`compile_folder`'s
    inductor caches, or loads that shape's graph saved there by an earlier process
    (:mod:`~entmtp_hf.decoding.precompiled`, where the keywords allow saving one)."""

    def __init__(self, model, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self.folder = compile_folder(model)
        self._model = model
        self._compiled = torch.compile(model.__call__, **kwargs)
        #: whether each shape's graph is saved to (and loaded from) the folder
        self.saves_graphs = precompiled.saves_graphs(kwargs) and precompiled.plain_weights(model)
        self._graphs: dict[tuple, Callable[..., Any]] = {}
        #: seconds the first call of each shape took (compiling, or loading a saved graph), in order
        self.compile_seconds: list[tuple[str, float]] = []
        #: the (rows, tree nodes) verification shapes compiled ahead of decoding
        #: (:func:`~entmtp_hf.decoding.loop.precompile`), and whether it warned of dynamo's graph limit
        self.verify_shapes: set[tuple[int, int]] = set()
        self.warned_limit = False

    def __call__(self, **kwargs: Any) -> Any:
        hold_current(self._model)
        key = (_shape_key(kwargs), self._model.training)
        graph = self._graphs.get(key)
        if graph is not None:
            try:
                return graph(**kwargs)
            except precompiled.Refused:  # e.g. a cache written with autograd on: dynamo compiles for it
                return self._compiled(**kwargs)
        with inductor_cache(self.folder) as folder:
            saved = folder / "precompiled" / precompiled.artifact_key(self._model, key, self.kwargs)
            graph, out = self._load(saved, kwargs) if self.saves_graphs else (None, None)
            if graph is None:  # nothing saved, or saved for calls unlike this one (kept for those)
                save = self.saves_graphs and not saved.exists()
                graph, out = self._compile(saved if save else None, kwargs, folder)
        self._graphs[key] = graph
        return out

    def _load(self, saved: Path, kwargs: dict[str, Any]) -> tuple[Callable[..., Any] | None, Any]:
        """The graph saved at ``saved`` and its output for this call; (None, None) when there is none
        or its guards refuse this call."""
        t0 = time.perf_counter()
        graph = precompiled.load(saved, self._model)
        if graph is None:
            return None, None
        try:
            out = graph(**kwargs)
        except precompiled.Refused:
            return None, None
        what, seconds = _describe(kwargs), time.perf_counter() - t0
        self.compile_seconds.append((f"{what}, loaded", seconds))
        tqdm.write(
            f"entmtp-hf: loaded the compiled forward for {what} from {saved.parent} in {seconds:.1f} s", file=sys.stderr
        )
        return graph, out

    def _compile(self, save_to: Path | None, kwargs: dict[str, Any], folder: Path) -> tuple[Callable[..., Any], Any]:
        """This call's graph compiled (announced, timed; inductor's caches in ``folder``), saved at
        ``save_to`` if given, and its output."""
        what = _describe(kwargs)
        later = (
            f"a later process loads it from {save_to.parent}"
            if save_to
            else f"less once inductor's caches in {folder} hold it"
        )
        tqdm.write(
            f"entmtp-hf: compiling the forward for {what}: once per shape, a minute or more; {later}", file=sys.stderr
        )
        t0 = time.perf_counter()
        with _ticking(f"entmtp-hf: compiling {what}"):
            graph = precompiled.compile_and_save(save_to, self._model, self.kwargs, kwargs) if save_to else None
            graph = graph or self._compiled
            out = graph(**kwargs)
        seconds = time.perf_counter() - t0
        self.compile_seconds.append((what, seconds))
        tqdm.write(f"entmtp-hf: compiled the forward for {what} in {seconds:.0f} s", file=sys.stderr)
        return graph, out

    def __reduce__(self):
        """A copy of the model (deep copy, pickle) gets a compiled forward of its own: a frozen graph
        holds its model's weights as constants (a saved graph is loaded again, for the copy)."""
        return (_not_compiled, ())


def compiled_call(model, config: CompileConfig | None = None) -> Callable[..., Any]:
    """``model``'s forward compiled with :func:`compile_kwargs` of ``config`` (one
    :class:`CompiledForward` per model and keywords, reused by every later call)."""
    kwargs = compile_kwargs(config, next(model.parameters()).device, model.dtype, routed=bool(kernel_routing(model)))
    calls = vars(model).setdefault(_COMPILED_ATTR, {})
    token = json.dumps(kwargs, sort_keys=True, default=repr)
    if calls.get(token) is None:
        calls[token] = CompiledForward(model, kwargs)
    return calls[token]


def compiled_generation(config: CompileConfig | None = None, *, max_cache_len: int | None = None) -> dict[str, Any]:
    """``generate`` keywords of compiled decoding: a static cache (``max_cache_len`` slots at least:
    one graph serves every call that fits) and ``config`` (default ``CompileConfig()``), marked to
    compile on a CPU too (transformers compiles only on accelerators unless told)."""
    config = dataclasses.replace(config) if config is not None else CompileConfig()
    config._compile_all_devices = True
    kwargs: dict[str, Any] = {"cache_implementation": "static", "compile_config": config}
    if max_cache_len is not None:
        kwargs["max_cache_len"] = max_cache_len
    return kwargs


def use_compiled_decoding(model, config: CompileConfig | None = None, *, max_cache_len: int = 512) -> None:
    """Make compiled decoding ``model``'s default: its plain ``generate`` and its EntMTP calls then run
    :func:`compiled_call`'s forward on a static cache of ``max_cache_len`` slots or more (a longer call
    compiles graphs of its own length, announced). ``model`` has EntMTP enabled: its
    ``get_compiled_call`` gives this module's compiled forward."""
    kwargs = compiled_generation(config, max_cache_len=max_cache_len)
    if not isinstance(model.get_compiled_call(kwargs["compile_config"]), CompiledForward):
        raise EntMTPError(
            f"{type(model).__name__} compiles through transformers' own route: call enable_entmtp(model, heads) "
            "first, so that plain and EntMTP decoding share this package's compiled forward"
        )
    model.generation_config.update(**kwargs)
