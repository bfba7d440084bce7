"""Build and load the C++ CPU kernels in `csrc/` (plain C entry points called through ctypes).

Each source is compiled once per machine with `torch.utils.cpp_extension.load` (-O3
-march=native -fopenmp, cached in the torch extensions dir under a name keyed by the CPU
capability, so a shared cache never hands one CPU another's build). Nothing compiles at import:
a kernel module calls `build_library` from its own cached `load_library`. If compiling fails
(no compiler, no ninja) the caller gets None and logs one warning; every call then takes the
torch path. `QSERVE_CPU_KERNELS=0` turns all C++ paths off; `QSERVE_CPU_KERNELS=require` makes a
failed build (or a missing compiler) an error instead of a fallback (CI runs the installed wheel
so).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from qserve.errors import QServeError

logger = logging.getLogger("qserve")

ENV_VAR = "QSERVE_CPU_KERNELS"
CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# dtype codes of the C++ sources (csrc/cpu_dtypes.h; fp8 codes for KV pages only)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PAGE_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def enabled() -> bool:
    """The C++ paths are on unless QSERVE_CPU_KERNELS=0 (read on every call: ops ask per call,
    so the parse is cached per raw value)."""
    return _parse_enabled(os.environ.get(ENV_VAR, "1"))


@functools.lru_cache(maxsize=8)
def _parse_enabled(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "off", "no")


def constant_while_tracing(fn: Callable[[], bool]) -> Callable[[], bool]:
    """`torch.compiler.assume_constant_result(fn)`: torch.compile calls `fn` once while tracing
    and bakes the answer into the graph. Sets the marker that does so directly, because the
    public decorator imports torch._dynamo (1.5 s at import; tests check the marker)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def required() -> bool:
    """QSERVE_CPU_KERNELS=require: a kernel that cannot be built is an error, not a fallback."""
    return os.environ.get(ENV_VAR, "").strip().lower() == "require"


def compiler() -> str | None:
    """The C++ compiler torch's extension builder will run ($CXX, else c++), if on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _unavailable(message: str) -> None:
    """One warning (the torch path takes over), or, when the kernels are required, an error."""
    if required():
        raise QServeError(f"{message} ({ENV_VAR}=require)")
    logger.warning("%s", message)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH; a pip-installed one sits beside this interpreter."""
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        scripts = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
        os.environ["PATH"] = os.pathsep.join([*scripts, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


# The launch recorder of the step graph being captured (qserve/engine/step_graph.py), if any.
_recorder: Callable[[Callable[..., int], tuple], None] | None = None


@contextlib.contextmanager
def recording_launches(record: Callable[[Callable[..., int], tuple], None]) -> Iterator[None]:
    """While active, every kernel launch also calls record(fn, args) before it runs, so a step
    graph can replay the launches later with the same (raw pointer) arguments."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("kernel launches are already being recorded")
    _recorder = record
    try:
        yield
    finally:
        _recorder = None


def _launcher(fn: Callable[..., int]) -> Callable[..., int]:
    def launch(*args: object) -> int:
        if _recorder is not None:
            _recorder(fn, args)
        return fn(*args)

    return launch


class KernelLibrary:
    """A loaded library's declared entry points as attributes. An entry point with arguments
    is a kernel returning a status (0: done) and goes through `_launcher`, which a step graph's
    capture records; an argument-less one is a query (which code the build took), called
    directly."""

    def __init__(self, lib: ctypes.CDLL, symbols: dict[str, tuple[list[type], type]]) -> None:
        self._lib = lib  # keeps the library loaded
        for name, (argtypes, restype) in symbols.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name, _launcher(fn) if argtypes else fn)


def extension_name(stem: str) -> str:
    """`qserve_<stem>_<avx2|avx512|...>`: one build per CPU capability."""
    return f"qserve_{stem}_{torch.backends.cpu.get_cpu_capability().lower()}"


def build_library(
    stem: str,
    source: Path,
    symbols: dict[str, tuple[list[type], type]],
    what: str,
    extra_cflags: tuple[str, ...] = (),
) -> KernelLibrary | None:
    """Compile `source` (first call on this machine, a few seconds), load it and set each
    symbol's (argtypes, restype). None, with one warning naming `what`, if that fails."""
    if compiler() is None:
        cxx = os.environ.get("CXX", "c++")
        _unavailable(f"no C++ compiler ({cxx}): {what} takes the torch path")
        return None
    try:
        lib = KernelLibrary(ctypes.CDLL(str(_build(stem, source, extra_cflags))), symbols)
    except Exception as e:  # no ninja, a failed build: the torch path still works
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        logger.debug("%s build failure", what, exc_info=True)
        _unavailable(f"{what} kernel unavailable, using the torch path: {first_line}")
        return None
    return lib


def _build(stem: str, source: Path, extra_cflags: tuple[str, ...] = ()) -> str:
    """Path of the shared library, compiled unless the torch extensions dir already has it."""
    from torch.utils import cpp_extension

    with _ninja_on_path():
        return cpp_extension.load(
            name=extension_name(stem),
            sources=[str(source)],
            extra_cflags=[*CFLAGS, *extra_cflags],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
