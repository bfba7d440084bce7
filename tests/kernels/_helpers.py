"""Test helpers shared by the kernel tests."""

import torch


def assert_out_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Kernel against reference: same shape and dtype, close to one output rounding."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    eps = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[ref.dtype]
    atol = 2 * eps * ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=atol)
