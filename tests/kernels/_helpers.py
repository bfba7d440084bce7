"""Test helpers shared by the kernel tests."""

import ctypes

import pytest
import torch

from qserve.kernels import cpu_build


def require_built(library: ctypes.CDLL | None, what: str) -> None:
    """Skip where there is no C++ compiler (the torch path is tested elsewhere); where there is
    one, the kernel must have built (ninja comes with qserve), so a failed build fails."""
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler: the torch path is tested elsewhere")
    assert library is not None, f"the {what} kernel failed to compile"


def assert_out_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Kernel against reference: same shape and dtype, close to one output rounding."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    eps = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[ref.dtype]
    atol = 2 * eps * ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=atol)
