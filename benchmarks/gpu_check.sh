#!/usr/bin/env bash
# GPU check: the kernel tests on CUDA (compiled Triton, no interpreter), the compiled decode step
# as CUDA graphs (tests, then ms/token against eager and the memory-bandwidth floor), then the
# kernel bandwidth benchmark. Run from the repository root on a machine with a CUDA device.
# tests/kernels includes the model's fused-MoE path (test_moe_fused.py): the tiny Mixtral and
# Qwen3-MoE, dense and GPTQ, fp32 and bf16, through the compiled fused_moe kernel against the
# per-expert CUDA path, and the engine's greedy tokens through it.
# tests/engine/test_cuda_graphs.py: every tiny architecture's greedy tokens with CUDA graphs
# equal --enforce-eager's (fp32), and a W4 checkpoint's (bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
unset TRITON_INTERPRET
mkdir -p out
python -m pytest tests/kernels tests/engine/test_cuda_graphs.py -q "$@"
python benchmarks/decode.py --device cuda --skip-hf --batch-sizes 1 64 \
    --output out/bench_decode_cuda.json
python benchmarks/kernels.py --json out/bench_kernels.json
