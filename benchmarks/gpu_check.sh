#!/usr/bin/env bash
# GPU check for the kernels: the kernel tests on CUDA (compiled Triton, no interpreter), then the
# bandwidth benchmark. Run from the repository root on a machine with a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
unset TRITON_INTERPRET
python -m pytest tests/kernels -q "$@"
python benchmarks/kernels.py --json out/bench_kernels.json
