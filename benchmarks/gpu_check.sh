#!/usr/bin/env bash
# GPU check for the kernels: the kernel tests on CUDA (compiled Triton, no interpreter), then the
# bandwidth benchmark. Run from the repository root on a machine with a CUDA device.
# tests/kernels includes the model's fused-MoE path (test_moe_fused.py): the tiny Mixtral and
# Qwen3-MoE, dense and GPTQ, fp32 and bf16, through the compiled fused_moe kernel against the
# per-expert CUDA path, and the engine's greedy tokens through it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
unset TRITON_INTERPRET
python -m pytest tests/kernels -q "$@"
python benchmarks/kernels.py --json out/bench_kernels.json
