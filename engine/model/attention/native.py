"""The C paged-attention kernel (csrc/paged_attention.c), compiled at first use and loaded
with ctypes.

Plain C with no torch headers compiles in a fraction of a second, so the kernel is built on
the machine that runs it (with -march=native) instead of at install time: setup stays
a pure-Python install, and a machine without a C compiler falls back to the PyTorch
backend with the reason at hand (`kernel_status()`). The shared object is cached under
$SCHEDTOP_KERNEL_CACHE (else $XDG_CACHE_HOME/schedtop/kernels, else
~/.cache/schedtop/kernels), named by a hash of the source, the flags, the compiler and
the CPU, and written by rename so that concurrent first uses do not collide."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
# -ffast-math lets the reductions and expf vectorize; the kernel never relies on inf/NaN.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-shared"]
LIBS = ["-lm", "-lpthread"]
COMPILE_TIMEOUT_S = 120

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
# paged_attention_rows's parameters, in order (see the C source)
ARGTYPES: list[Any] = [
    *(_ptr, _i64, _i64),  # q, its token and head strides
    *(_ptr, _ptr, _i64, _i64, _i64),  # k_cache, v_cache, block/slot/head strides
    *(_ptr, _i64),  # block_table, its row stride
    *(_ptr, _ptr, _ptr, _i64),  # rows, row_req, row_len, n_rows
    *(_ptr, _i64, _i64),  # out, its token and head strides
    *(_i32, _i32, _i32, _i32),  # num_heads, num_kv_heads, head_dim, block_size
    *(_f32, _i32, _i32),  # scale, max_len, num_threads
]


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    if os.environ.get("SCHEDTOP_KERNEL_CACHE"):
        return Path(os.environ["SCHEDTOP_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "schedtop" / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(target_dir: Path | None = None) -> Path:
    """Compile the kernel (or find it already compiled); returns the shared object."""
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set CC, or install gcc)")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS + LIBS).encode(), cc.encode()):
        key.update(part)
    key.update(_cpu_signature().encode())
    out_dir = target_dir or cache_dir()
    so = out_dir / f"paged_attention-{key.hexdigest()[:16]}.so"
    if so.exists():
        return so
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {out_dir}: {e}") from None
    try:
        proc = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE), *LIBS],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, so)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{cc}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


@functools.cache
def _load() -> tuple[ctypes._CFuncPtr | None, str]:  # type: ignore[name-defined]
    if os.environ.get("SCHEDTOP_NO_C_KERNEL"):
        return None, "disabled by SCHEDTOP_NO_C_KERNEL"
    try:
        lib = ctypes.CDLL(str(build()))
    except (KernelUnavailable, OSError) as e:
        return None, str(e)
    fn = lib.paged_attention_rows
    fn.argtypes = ARGTYPES
    fn.restype = ctypes.c_int
    return fn, "ok"


def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernel's entry point, or None where it cannot be had (see kernel_status)."""
    return _load()[0]


def kernel_status() -> str:
    """'ok', or why the kernel is not available on this machine."""
    return _load()[1]
