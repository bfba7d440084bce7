"""Session-wide test setup.

Without CUDA, Triton kernels run under the interpreter. TRITON_INTERPRET must be set before
anything imports triton: transformers imports it as soon as a model class is loaded, and test
modules import transformers at collection, before tests/kernels/conftest.py runs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
