"""The embedded default: the demo model with its shipped heads and banks, in one line.

``load_demo()`` returns SmolLM2-135M-Instruct (see :mod:`entmtp_hf.tools.models`) with its
default drafter enabled (:data:`DEFAULT_DRAFTER`), its tokenizer and the folder of the tree
banks searched for that drafter; the drafters and banks are package data, so this works from
an installed wheel. ``load_demo(model="gemma-3-270m")`` does the same for Gemma 3 270M with its
shipped drafter (:data:`SHIPPED_DRAFTERS`), and ``load_demo(model=..., heads=FOLDER)`` for any
model with a drafter built by ``entmtp-hf build-drafter`` (its banks in ``FOLDER/banks``).
``load_demo(heads="mtp")`` gives SmolLM2 with MTP layers trained for it, in transformers' native
layout (:data:`DEMO_MTP`), so that ``model.generate(..., use_mtp=True)`` runs transformers' own MTP
decoding of the very layers EntMTP drafts trees with.
``python -m entmtp_hf.demo`` (what ``make demo`` runs, :mod:`entmtp_hf.demo.run`) streams three
answers and measures the speed-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..banks.bank import TopologyBank, shipped_bank_path
from ..calibration import calibrate as calibrate_costs
from ..config import EntMTPConfig
from ..decoding.compiled import use_compiled_decoding
from ..integration import enable_entmtp
from ..tools.models import load_base_model

ASSETS = Path(__file__).resolve().parent / "assets"
DEMO_HEADS = ASSETS / "smollm2-135m-hydra"
DEMO_MEDUSA_HEADS = ASSETS / "smollm2-135m-medusa"
DEMO_EAGLE_HEADS = ASSETS / "smollm2-135m-eagle"
DEMO_BANK = "smollm2-135m-cpu"
DEMO_EAGLE_BANK = "smollm2-135m-cpu-eagle"  # searched with the EAGLE-style drafter
#: the EAGLE-3 drafter (``build-drafter --arch eagle3``): the layout vLLM, SGLang and TensorRT-LLM load
DEMO_EAGLE3_HEADS = ASSETS / "smollm2-135m-eagle3"
DEMO_EAGLE3_BANK = "smollm2-135m-cpu-eagle3"  # searched with the EAGLE-3 drafter
#: MTP layers trained for SmolLM2 (``build-drafter --arch mtp``): their ``model-mtp.safetensors``, drafting
#: settings and card, without the base weights (the demo model's, joined to them in the user cache)
DEMO_MTP = ASSETS / "smollm2-135m-mtp"
DEMO_MTP_BANK = "smollm2-135m-cpu-mtp"  # searched with those MTP layers
#: the ``heads`` of :func:`load_demo` that names a model's MTP layers
MTP_HEADS = "mtp"
FALLBACK_BANK = "published-defaults"

DEMO_PROMPTS = (
    (
        "humaneval",
        "Write a Python function `is_palindrome(s)` that returns True when the string s reads "
        "the same forwards and backwards, ignoring case and spaces.",
    ),
    (
        "gsm8k",
        "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them. "
        "How many muffins are left? Explain step by step.",
    ),
    ("chat", "Give me three tips for staying focused while studying."),
)


#: the shipped drafters by name, with the banks searched for each
DEMO_DRAFTERS = {
    "hydra": (DEMO_HEADS, DEMO_BANK),
    "eagle": (DEMO_EAGLE_HEADS, DEMO_EAGLE_BANK),
    "eagle3": (DEMO_EAGLE3_HEADS, DEMO_EAGLE3_BANK),
}
#: the drafters shipped for the other demo models (model name -> heads, bank), each built with
#: ``entmtp-hf build-drafter`` (docs/your-model.md)
SHIPPED_DRAFTERS = {"gemma-3-270m": (ASSETS / "gemma-3-270m-eagle", "gemma-3-270m-cpu-eagle")}
#: what ``load_demo()`` enables: the drafter the benchmark shows faster (EntMTP* with the
#: EAGLE-style drafter ran 1.03-1.05x EntMTP* with the Hydra heads per prompt on every task,
#: docs/results.md); ``load_demo(heads="hydra")`` gives the Hydra heads
DEFAULT_DRAFTER = "eagle"


def demo_bank_dir(drafter: str = DEFAULT_DRAFTER) -> Path:
    """The demo model's calibrated banks for ``drafter`` if shipped, else the published defaults."""
    for name in (DEMO_DRAFTERS[drafter][1], FALLBACK_BANK):
        try:
            return Path(shipped_bank_path(name))
        except (FileNotFoundError, ValueError):
            continue
    raise FileNotFoundError("no shipped tree bank found in the package")


def load_demo(
    heads: str | Path | None = None,
    *,
    model: str | None = None,
    banks: str | Path | None = None,
    cache_dir: str | Path | None = None,
    calibrate: bool | Sequence[int] = False,
    precision: str = "fp32",
    compile: bool = False,
):
    """``(model, tokenizer, bank_dir)``: a demo model with a drafter enabled.

    ``model``: ``None`` (SmolLM2-135M-Instruct), a name of :data:`~entmtp_hf.tools.models.DEMO_MODELS`
    (``"gemma-3-270m"``), a Hub id or a local folder. For SmolLM2, ``heads`` is ``"eagle"`` (the
    EAGLE-style drafter, the default), ``"eagle3"`` (the EAGLE-3 drafter, which ``export-heads``
    writes for vLLM, SGLang and TensorRT-LLM) or ``"hydra"`` (the Hydra heads), each with the banks
    searched for it, or a heads folder (with the banks in its ``banks/`` if there, else ``banks``, else the
    Hydra heads'). Gemma 3 270M gets its shipped EAGLE-style drafter and banks without ``heads``.
    For any other model (or another drafter) ``heads`` is the folder ``entmtp-hf build-drafter``
    wrote, and the banks are ``banks`` or that folder's ``banks/``. ``heads="mtp"``: MTP layers in
    transformers' native layout (:func:`load_mtp_demo`), SmolLM2's shipped ones or, with ``model``, the
    folder ``build-drafter --arch mtp`` wrote.
    ``calibrate``: as :func:`~entmtp_hf.enable_entmtp`'s (measure this machine's step costs now,
    so that the banks rank their trees for it). ``precision``: the base model's weights, ``"fp32"``,
    ``"bf16"`` or ``"int8"`` (torchao weight-only, :func:`~entmtp_hf.tools.models.precision_kwargs`);
    the drafter follows the LM head's dtype. ``compile=True``: compiled decoding by default
    (:func:`~entmtp_hf.decoding.compiled.use_compiled_decoding`), for plain ``generate`` as for
    EntMTP; the first call of each shape compiles, announced (with ``calibrate``, the compiled step's
    costs are the ones measured: a graph per probed size, the first time on a machine)."""
    from ..tools.models import DEFAULT_DEMO

    if heads == MTP_HEADS:
        if (precision, compile) != ("fp32", False):
            raise ValueError("heads='mtp' loads fp32 and eager only: drop precision= and compile=")
        return load_mtp_demo(model, banks=banks, cache_dir=cache_dir, calibrate=calibrate)
    if model in SHIPPED_DRAFTERS and heads in (None, "eagle"):
        heads, bank = SHIPPED_DRAFTERS[model]
        bank_dir = Path(banks) if banks is not None else Path(shipped_bank_path(bank))
    elif model is not None and model != DEFAULT_DEMO:
        heads, bank_dir = own_drafter(model, heads, banks)
    else:
        drafter = (
            heads if isinstance(heads, str) and heads in DEMO_DRAFTERS else DEFAULT_DRAFTER if heads is None else None
        )
        heads = DEMO_DRAFTERS[drafter][0] if drafter is not None else Path(heads)
        beside = heads / "banks"  # where build-drafter puts a drafter's banks
        if banks is None and drafter is None and any(beside.glob("*.safetensors")):
            banks = beside
        bank_dir = (
            Path(banks) if banks is not None else demo_bank_dir(drafter or "hydra")
        )  # a folder: the Hydra heads' banks
    if not (heads / "config.json").exists():
        raise FileNotFoundError(
            f"no draft heads at {heads}: train them with `entmtp-hf train-heads` (see docs/training.md)"
        )
    loaded, tokenizer = load_base_model(model, cache_dir=cache_dir, precision=precision)
    enable_entmtp(loaded, str(heads), calibrate=False if compile else calibrate)
    if compile:
        use_compiled_decoding(loaded)
        if calibrate is not False and calibrate is not None:  # the compiled step's costs, as decoding runs it
            calibrate_costs(loaded, batch_sizes=(1,) if calibrate is True else calibrate)
    return loaded, tokenizer, bank_dir


def load_mtp_demo(
    model: str | Path | None = None,
    *,
    banks: str | Path | None = None,
    cache_dir: str | Path | None = None,
    calibrate: bool | Sequence[int] = False,
):
    """``(model, tokenizer, bank_dir)``: a model with MTP layers in transformers' native layout, loaded as
    a user loads it (``trust_remote_code=True``: its ``modeling_mtp.py`` says where the layers sit) and
    drafting with them as its banks were searched (the folder's drafting settings). ``model``: ``None``
    for SmolLM2 with its shipped layers and banks, or a folder ``build-drafter --arch mtp`` wrote (banks:
    ``banks``, else its ``banks/``)."""
    from ..tools.models import DEFAULT_DEMO
    from ..tools.training.mtp_layout import is_mtp_checkpoint, load_mtp_checkpoint, mtp_drafter

    if model is None or model == DEFAULT_DEMO:
        folder = demo_mtp_dir(cache_dir)
        try:
            bank_dir = Path(banks) if banks is not None else Path(shipped_bank_path(DEMO_MTP_BANK))
        except ValueError as e:
            raise FileNotFoundError(f"no banks ship for the demo model's MTP layers ({e}): pass banks=FOLDER") from e
    else:
        folder = Path(model)
        if not is_mtp_checkpoint(folder):
            raise FileNotFoundError(
                f"model={str(model)!r} is no folder of MTP layers in transformers' native layout: build one with "
                f"`entmtp-hf build-drafter --model BASE --arch mtp --work-dir runs/mtp --out {model}` "
                "(docs/your-model.md); a checkpoint that carries MTP layers of its own (DeepSeek-V3, GLM-4.5, ...) "
                "needs no folder: load it and call enable_entmtp(model, 'mtp')"
            )
        bank_dir = Path(banks) if banks is not None else folder / "banks"
        if not any(bank_dir.glob("*.safetensors")):
            raise FileNotFoundError(f"{bank_dir} holds no tree banks: pass banks=FOLDER")
    loaded, tokenizer = load_mtp_checkpoint(folder)
    enable_entmtp(loaded, mtp_drafter(loaded, folder), calibrate=calibrate)
    return loaded, tokenizer, bank_dir


def demo_mtp_dir(cache_dir: str | Path | None = None) -> Path:
    """The demo model with its shipped MTP layers in transformers' native layout: a folder beside the demo
    model's copy in the cache (its weights hard-linked where the file system allows), written once and
    again whenever the shipped layers differ from the ones it holds."""
    import filecmp
    import os

    from ..tools.models import DEFAULT_DEMO, demo_model_dir
    from ..tools.training.mtp_layout import (
        BASE_SHARD,
        MODELING_FILE,
        MTP_SHARD,
        drafting_settings,
        write_mtp_checkpoint,
    )

    shipped = DEMO_MTP / MTP_SHARD
    if not shipped.is_file():
        raise FileNotFoundError(
            "the MTP layers for SmolLM2-135M-Instruct are not shipped in this version: build them with "
            f"`entmtp-hf build-drafter --model {DEFAULT_DEMO} --arch mtp --work-dir runs/smollm2-mtp --out "
            "smollm2-mtp` (docs/your-model.md), then load_demo(model='smollm2-mtp', heads='mtp')"
        )
    base = demo_model_dir(cache_dir, DEFAULT_DEMO)
    target = base.with_name(base.name + "-mtp")
    settings = drafting_settings(DEMO_MTP)
    weights = base / "model.safetensors"
    current = (
        all((target / f).is_file() for f in (MODELING_FILE, MTP_SHARD, BASE_SHARD))
        and filecmp.cmp(shipped, target / MTP_SHARD, shallow=False)
        and drafting_settings(target) == settings
        and (os.path.samefile(weights, target / BASE_SHARD) or filecmp.cmp(weights, target / BASE_SHARD, shallow=False))
    )
    if not current:
        card = DEMO_MTP / "README.md"
        write_mtp_checkpoint(
            base, shipped, target, drafting=settings or None, readme=card.read_text() if card.is_file() else None
        )
    return target


def own_drafter(model: str, heads: str | Path | None, banks: str | Path | None) -> tuple[Path, Path]:
    """The heads folder and the bank folder of a model without a shipped drafter, or an error
    that says how to build them."""
    build = (
        f"build them with `entmtp-hf build-drafter --model {model} --work-dir runs/drafter --out my-drafter` "
        f"(docs/your-model.md), then load_demo(model={model!r}, heads='my-drafter')"
    )
    if heads is None or (isinstance(heads, str) and heads in DEMO_DRAFTERS):
        what = "no heads given" if heads is None else f"the shipped {heads!r} drafter is SmolLM2-135M-Instruct's"
        raise FileNotFoundError(f"no drafter ships for {model!r} ({what}): {build}")
    heads = Path(heads)
    if not (heads / "config.json").is_file():
        raise FileNotFoundError(f"heads={str(heads)!r} holds no draft heads (no config.json): {build}")
    bank_dir = Path(banks) if banks is not None else heads / "banks"
    if not any(bank_dir.glob("*.safetensors")):
        where = f"banks={str(bank_dir)!r} holds" if banks is not None else f"{heads} has no banks/ folder with"
        raise FileNotFoundError(f"{where} no tree banks: pass banks=FOLDER, or {build}")
    return heads, bank_dir


def config_for(bank_dir: Path, task: str, policy: str | None = None) -> EntMTPConfig:
    """EntMTP config for a task, falling back to the bank's ``default`` task."""
    tasks = TopologyBank.list_tasks(bank_dir)
    chosen = task if task in tasks else "default" if "default" in tasks else tasks[0]
    return EntMTPConfig(bank=str(bank_dir), task=chosen, policy=policy)
