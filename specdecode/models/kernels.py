"""The project's bf16 kernels: one extension, built once per machine, loaded on demand.

Three builds of the same functions, one per kind of CPU, each with its own bf16 matrix
product and attention over the cache:
- "amx" (CPUs with AMX, Intel Sapphire Rapids and later): amx_linear.cpp on AMX tiles,
  avx512_attention.cpp;
- "avx512" (AVX-512 with AVX512_BF16 and VNNI but no AMX, such as AMD Zen 4):
  avx512_linear.cpp on VDPBF16PS, avx512_attention.cpp;
- "avx2" (other x86-64 CPUs, such as AMD Zen 2 and Zen 3): avx2_linear.cpp and
  avx2_attention.cpp, on fp32 FMA.
The rest is written once and compiled by every build at its own width: the fused small
ops of a layer (ops.cpp, over vec.h's vector type), the rotary embedding (rope.cpp), every
layer of a pass in one call (decoder_layer.cpp) and the products over quantized GGUF
blocks (quant_linear.cpp: AVX2, with VNNI's VPDPBUSD where the build has it, and AMX's
TDPBSUD for passes over many rows), a read of memory in several streams a thread, for
`speed`'s bandwidth limit (bandwidth.cpp), and the products' instruction run at its peak,
for the floor `speed` sets under a verify pass (peak.cpp).

`kernel()` returns the compiled module, or None where none can run (no AVX2, no compiler)
so that `Linear` falls back to oneDNN or F.linear. The build (1-3 minutes) goes to
$SPECDECODE_HOME/kernels/, keyed by the sources and torch version, and is reused after.
SPECDECODE_KERNEL=onednn turns the kernels off; =amx or =avx2 picks that build and makes
its absence an error (=avx2 runs the AVX2 build on an AVX-512 or AMX CPU too).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.errors import SpecDecodeError
from specdecode.models.huge_pages import on_huge_pages
from specdecode.models.store import home

KERNEL_ENV = "SPECDECODE_KERNEL"
KINDS = ("amx", "avx512", "avx2")  # the builds, best first
CHOICES = ("auto", *KINDS, "onednn")
_HERE = Path(__file__).parent
_SHARED = ("ops.cpp", "rope.cpp", "decoder_layer.cpp", "quant_linear.cpp", "bandwidth.cpp", "peak.cpp")  # written once, every build
SOURCES = {
    "amx": [_HERE / n for n in ("amx_linear.cpp", "avx512_attention.cpp", *_SHARED)],
    "avx512": [_HERE / n for n in ("avx512_linear.cpp", "avx512_attention.cpp", *_SHARED)],
    "avx2": [_HERE / n for n in ("avx2_linear.cpp", "avx2_attention.cpp", *_SHARED)],
}
_SHARED_HEADERS = ("vec.h", "attention_host.h", "kernels.h", "bindings.h")
HEADERS = {  # part of the build's key, not compiled alone
    "amx": [_HERE / n for n in (*_SHARED_HEADERS, "amx_tiles.h")],
    "avx512": [_HERE / n for n in (*_SHARED_HEADERS, "tile_prefetch.h")],
    "avx2": [_HERE / n for n in (*_SHARED_HEADERS, "tile_prefetch.h")],
}
FLAGS = {
    "amx": ["-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
            "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-fopenmp"],
    "avx512": ["-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
               "-mavx512bf16", "-mavx512vnni", "-fopenmp"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
}
GROUP, STEP = 64, 32  # AMX: outputs per packed group, K per tile step (see amx_linear.cpp)
BLOCK = 32  # AVX2: outputs per packed block (see avx2_linear.cpp)
BLOCK_AVX512 = 64  # AVX-512: outputs per packed block (see avx512_linear.cpp)


REQUIRED_FLAGS = {
    "amx": ("amx_bf16", "amx_int8", "amx_tile", "avx512_vnni"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
    "avx2": ("avx2", "fma"),
}


def cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_has(kind: str) -> bool:
    return all(flag in cpu_flags() for flag in REQUIRED_FLAGS[kind])


def cpu_has_amx() -> bool:
    return cpu_has("amx")


@functools.cache
def kernel():
    """The built module for this CPU (its `kind`: "amx" or "avx2"), or None."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in CHOICES:
        raise SpecDecodeError(f"{KERNEL_ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "onednn":
        return None
    kind = choice if choice != "auto" else next((k for k in KINDS if cpu_has(k)), None)
    if kind is None:  # a fact of the machine, not a failure: no warning
        return None
    try:
        if not cpu_has(kind):
            raise RuntimeError(f"this CPU lacks {' and '.join(REQUIRED_FLAGS[kind])}")
        module = _build(kind)
        if kind == "amx" and not module.request_amx():
            raise RuntimeError("the kernel refused AMX state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        module.kind = kind
        return module
    except Exception as e:  # a missing compiler, an old kernel: run on oneDNN or torch instead
        if choice != "auto":
            raise SpecDecodeError(f"the {kind} kernel is not available: {e}") from e
        warnings.warn(f"bf16 linear layers run without the {kind} kernel: {e}", stacklevel=2)
        return None


def kernel_kind() -> str | None:
    """"amx", "avx2", or None where no kernel runs."""
    module = kernel()
    return None if module is None else module.kind


@functools.cache
def source_tag(kind: str) -> str:
    """A hash of a build's sources and torch's version: it names the build's folder, and
    costs measured on one version of the kernels are not read back for another."""
    files = SOURCES[kind] + HEADERS[kind]
    return hashlib.sha256(b"".join(p.read_bytes() for p in files) + torch.__version__.encode()).hexdigest()[:12]


def _build(kind: str):
    import shutil

    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the pip wheel's binary, when the venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    build_dir = home() / "kernels" / f"{kind}-{source_tag(kind)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    name = f"specdecode_{kind}"
    with _build_lock(build_dir):
        if not (build_dir / f"{name}.so").exists():
            print(f"building the {kind} bf16 kernels (once per machine, one to three minutes)...", file=sys.stderr,
                  flush=True)
        return load(
            name=name,
            sources=[str(p) for p in SOURCES[kind]],
            build_directory=str(build_dir),
            extra_cflags=FLAGS[kind],
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch has already loaded
            verbose=False,
        )


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One process at a time checks or builds a folder's kernels. torch's own lock is a file
    that a build killed midway (Ctrl-C) leaves behind, and the next process would wait on
    it forever; this one is the OS's, released when its holder dies, so torch's file can
    only be such a leftover by the time this one is held."""
    with open(build_dir / "build.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building the kernels in {build_dir}...", file=sys.stderr, flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield  # the OS releases the lock when the file closes


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> the layout this machine's kernel reads."""
    kind = kernel_kind()
    return _pack_amx(weight) if kind == "amx" else _pack_avx512(weight) if kind == "avx512" else _pack_avx2(weight)


def _pack_avx512(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N/64, K/2, 128), zero-padded to whole blocks and even K: for each pair of
    K, the block's 64 outputs' two weights side by side (avx512_linear.cpp)."""
    N, K = weight.shape
    Np, Kp = -(-N // BLOCK_AVX512) * BLOCK_AVX512, K + K % 2
    w = F.pad(weight, (0, Kp - K, 0, Np - N)).view(Np // BLOCK_AVX512, BLOCK_AVX512, Kp // 2, 2)
    return on_huge_pages(w.permute(0, 2, 1, 3).reshape(Np // BLOCK_AVX512, Kp // 2, 2 * BLOCK_AVX512))


def _pack_avx2(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N/32, K, 32), zero-padded; within each half of 16 outputs, output i (0-7)
    at 2i and output 8 + i at 2i + 1 (avx2_linear.cpp)."""
    N, K = weight.shape
    Np = -(-N // BLOCK) * BLOCK
    w = F.pad(weight, (0, 0, 0, Np - N)).view(Np // BLOCK, 2, 2, 8, K)  # output 16 h + 8 e + i
    return on_huge_pages(w.permute(0, 4, 1, 3, 2).reshape(Np // BLOCK, K, BLOCK))  # (blocks, K, h i e)


def needs_padding(in_features: int) -> bool:
    """Whether linear() pads x along K for this machine's kernel (AMX: whole tile steps;
    AVX-512: an even K)."""
    kind = kernel_kind()
    return (kind == "amx" and in_features % STEP != 0) or (kind == "avx512" and in_features % 2 != 0)


def _pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> the AMX tiles (N/64, K/32, 4, 16, 16, 2), zero-padded."""
    N, K = weight.shape
    Np, Kp = -(-N // GROUP) * GROUP, -(-K // STEP) * STEP
    w = F.pad(weight, (0, Kp - K, 0, Np - N))
    return on_huge_pages(w.view(Np // GROUP, 4, 16, Kp // STEP, 16, 2).permute(0, 3, 1, 4, 2, 5))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x (M, K) bf16 -> (M, out_features) bf16, through the packed weight."""
    kind = kernel_kind()
    Kp = packed.shape[1] * STEP if kind == "amx" else packed.shape[1] * 2 if kind == "avx512" else x.shape[1]
    if x.shape[1] != Kp:
        x = F.pad(x, (0, Kp - x.shape[1]))
    return kernel().linear(x.contiguous(), packed, bias, out_features)
