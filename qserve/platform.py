"""What this machine is: its CPU's features, its memory, its devices. One place for every check
(the kernels, the engine's dtype choice, the recipes and the quantizer all ask here).

torch is imported inside the functions, so `qserve.recipe` (which imports `Hardware`) stays
importable without it.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qserve.errors import QServeError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Hardware:
    device: str  # cuda | cpu
    name: str  # GPU name, or the CPU's
    memory: int  # bytes: GPU memory (cuda) or RAM (cpu)
    compute_capability: float | None = None
    cpu_features: frozenset[str] = field(default_factory=frozenset)

    def describe(self) -> str:
        cc = f", compute capability {self.compute_capability}" if self.compute_capability else ""
        feats = f", {'+'.join(sorted(self.cpu_features))}" if self.cpu_features else ""
        return f"{self.device}: {self.name}, {self.memory / 2**30:.1f} GiB{cc}{feats}"


def detect_hardware() -> Hardware:
    """GPU 0 via torch when CUDA is available, else this CPU and its RAM."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cc = float(f"{props.major}.{props.minor}")
        return Hardware("cuda", props.name, props.total_memory, cc)
    return Hardware("cpu", cpu_name(), ram_bytes(), None, cpu_features())


@functools.cache
def native_half_matmul() -> bool:
    """AMX tiles or AVX-512 BF16: where oneDNN runs 16-bit matmuls faster than fp32."""
    import torch

    cpu = torch.cpu
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def cpu_features() -> frozenset[str]:
    """Of avx2, avx512 and bf16 (AMX or AVX-512 BF16), what this CPU has."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability().lower()  # default | avx2 | avx512
    features = {"avx2", "avx512"} if capability == "avx512" else {capability} & {"avx2"}
    return frozenset(features | ({"bf16"} if native_half_matmul() else set()))


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def resolve_device(device: str | None = None) -> torch.device:
    """`device` (cpu, cuda, cuda:N), or cuda when available, else cpu; one this machine lacks
    is refused here, before any work."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise QServeError(f"device must be cpu, cuda or cuda:N, got {device!r}", "device")
    working = torch.device(device)
    if working.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise QServeError(f"device {device}: CUDA is not available on this machine", "device")
        if (working.index or 0) >= count:
            raise QServeError(f"device {device}: this machine has {count} CUDA device(s)", "device")
    return working
