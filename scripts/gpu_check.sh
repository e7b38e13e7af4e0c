#!/usr/bin/env bash
# bf16 FSDP2 (world size 1) and LoRA on a random ~0.5B model with a 150k vocabulary: step-time split,
# tokens/s and peak GPU memory; then eager vs static-cache (compiled, CUDA graphs) rollouts on random
# Qwen2.5-0.5B and -1.5B shapes (tokens/s, warm-up, what compiling did: recompiles, CUDA-graph re-records
# and skips, graph breaks, eager fallbacks, each a FAIL; peak memory, and LoRA); then the bf16 numerics
# (the sampler/scorer gap under a Qwen-like generation config, LoRA updates kept in the static copy,
# weights moving under the shipped precision, LM-head gradients under autocast), PASS/FAIL each.
# Offline; the throughput part took 122 s on one H200 (before the static rollouts), the rest is not yet
# measured there.
#   bash scripts/gpu_check.sh                   # GPU, all three parts
#   bash scripts/gpu_check.sh --only rollouts   # GPU, the rollout comparison alone
#   bash scripts/gpu_check.sh --only numerics   # GPU, the numeric checks alone
#   bash scripts/gpu_check.sh --cpu --tiny      # CPU smoke run, seconds
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The package need not be installed: run it from the checkout. Nothing may reach the network.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHON="${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python )}"
exec timeout 900 "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
