"""The AMX bf16 linear kernel (amx_linear.cpp), the fused small ops of a bf16 layer
(cpu_ops.cpp), its attention over the cache (attention.cpp) and every layer of a pass in
one call (decoder_layer.cpp): one extension, built once per machine, loaded on demand.

`kernel()` returns the compiled module, or None where it cannot run (no AMX, no compiler)
so that `Linear` falls back to oneDNN. The build (about a minute) goes to
$SPECDECODE_HOME/kernels/, keyed by the source and torch version, and is reused after.
SPECDECODE_KERNEL=onednn turns the kernel off; =amx makes its absence an error.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import SpecDecodeError
from .huge_pages import on_huge_pages
from .store import home

KERNEL_ENV = "SPECDECODE_KERNEL"
CHOICES = ("auto", "amx", "onednn")
SOURCES = [Path(__file__).with_name(name) for name in ("amx_linear.cpp", "cpu_ops.cpp", "attention.cpp",
                                                    "decoder_layer.cpp")]
HEADERS = [Path(__file__).with_name("simd_math.h")]  # part of the build's key, not compiled alone
GROUP, STEP = 64, 32  # outputs per packed group, K per tile step (see amx_linear.cpp)
STALE_LOCK_S = 600  # a build takes about a minute; a lock this old belongs to a dead process


def cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags and "amx_tile" in flags


@functools.cache
def kernel():
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in CHOICES:
        raise SpecDecodeError(f"{KERNEL_ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "onednn":
        return None
    if not cpu_has_amx() and choice == "auto":  # a fact of the machine, not a failure: no warning
        return None
    try:
        if not cpu_has_amx():
            raise RuntimeError("this CPU has no AMX (amx_bf16, amx_tile)")
        module = _build()
        if not module.request_amx():
            raise RuntimeError("the kernel refused AMX state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        return module
    except Exception as e:  # a missing compiler, an old kernel: run on oneDNN instead
        if choice == "amx":
            raise SpecDecodeError(f"the AMX kernel is not available: {e}") from e
        warnings.warn(f"bf16 linear layers run without the AMX kernel: {e}", stacklevel=2)
        return None


def _build():
    import shutil

    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the pip wheel's binary, when the venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    tag = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + torch.__version__.encode()).hexdigest()[:12]
    build_dir = home() / "kernels" / f"amx-{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"  # torch's build lock; a build killed midway leaves it behind forever
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if not (build_dir / "specdecode_amx.so").exists():
        print("building the AMX bf16 kernel (once per machine, about a minute)...", file=sys.stderr, flush=True)
    return load(
        name="specdecode_amx",
        sources=[str(p) for p in SOURCES],
        build_directory=str(build_dir),
        extra_cflags=["-O3", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp"],
        extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch has already loaded
        verbose=False,
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> the kernel's tiles (N/64, K/32, 4, 16, 16, 2), zero-padded."""
    N, K = weight.shape
    Np, Kp = -(-N // GROUP) * GROUP, -(-K // STEP) * STEP
    w = F.pad(weight, (0, Kp - K, 0, Np - N))
    return on_huge_pages(w.view(Np // GROUP, 4, 16, Kp // STEP, 16, 2).permute(0, 3, 1, 4, 2, 5))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x (M, K) bf16 -> (M, out_features) bf16, through the packed weight."""
    Kp = packed.shape[1] * STEP
    if x.shape[1] != Kp:
        x = F.pad(x, (0, Kp - x.shape[1]))
    return kernel().linear(x.contiguous(), packed, bias, out_features)
