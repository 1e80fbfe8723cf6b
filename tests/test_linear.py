"""The bf16 linear layer: this machine's kernel (AMX, AVX-512 or AVX2) against F.linear,
and its rows' independence.

Greedy identity in bf16 rests on this: a verify pass over many tokens must give each
token bitwise the product of a one-token pass. Every kernel computes every row with the
same instructions in the same order, so that holds for any number of rows; oneDNN's
packed product holds it up to 11 rows only.
"""

import os
import select
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest
import torch
import torch.nn.functional as F

from specdecode.models import kernels
from specdecode.models import linear
from specdecode.models.linear import Linear

# The kernel tests skip only on a CPU without the kernel's instructions; where it has them,
# a build that fails fails them with the build's error (conftest.require_kernel).
needs_kernel = pytest.mark.usefixtures("kernel_module")
# what oneDNN needs to reorder a bf16 weight (linear.onednn_packs_bf16)
ONEDNN_BF16_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


def onednn_should_pack_bf16() -> bool:
    return any(flags <= kernels.cpu_flags() for flags in ONEDNN_BF16_FLAGS)


def weights(out_features: int, in_features: int, seed: int, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    return w, b


@needs_kernel
@pytest.mark.parametrize("shape", [(2048, 1536), (576, 1536), (100, 40), (64, 32), (7, 70), (33, 45)])
def test_kernel_product_matches_fp32_reference_within_bf16_rounding(shape):
    w, b = weights(*shape, seed=0)
    layer = Linear(w, b)
    assert layer.backend == kernels.kernel_kind()
    x = torch.randn(3, 5, shape[1]).bfloat16()
    got = layer(x)
    want = F.linear(x.float(), w.float(), b.float())  # exact up to fp32 sums
    assert got.shape == (3, 5, shape[0]) and got.dtype == torch.bfloat16
    # one bf16 rounding of the result (2^-8 relative) plus fp32 summation order
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (130, 100)])  # the first two split K
def test_kernel_rows_do_not_depend_on_the_row_count(shape):
    w, b = weights(*shape, seed=1)
    layer = Linear(w, b)
    x = torch.randn(40, shape[1]).bfloat16()
    together = layer(x)
    for rows in (1, 2, 11, 16, 17, 33):
        assert torch.equal(layer(x[:rows]), together[:rows]), rows
    for row in (0, 15, 16, 39):
        assert torch.equal(layer(x[row : row + 1]), together[row : row + 1]), row


@pytest.mark.parametrize("kind", kernels.KINDS)
def test_each_build_the_cpu_supports_compiles_and_is_exact(kind):
    """Every build whose instructions this CPU has must compile and multiply exactly, the
    AVX2 one included where this machine runs the AMX one (a minute's build, once per
    machine). A build that fails here fails the test with the compiler's error: only a CPU
    without the instructions skips."""
    if not kernels.cpu_has(kind):
        pytest.skip(f"this CPU lacks {' and '.join(kernels.REQUIRED_FLAGS[kind])}")
    module = kernels._build(kind)  # raises with the compiler's output
    if kind == "amx":
        assert module.request_amx(), "the kernel refused AMX state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    w, b = weights(130, 100, seed=4)
    x = torch.randn(20, 100).bfloat16()
    if kind == "amx":
        packed = kernels._pack_amx(w)
        x = F.pad(x, (0, packed.shape[1] * kernels.STEP - 100))  # whole tile steps
    else:
        packed = kernels._pack_avx512(w) if kind == "avx512" else kernels._pack_avx2(w)
    together = module.linear(x.contiguous(), packed, b, 130)
    reference = F.linear(x.float(), F.pad(w, (0, x.shape[1] - 100)).float(), b.float())
    torch.testing.assert_close(together.float(), reference, rtol=2**-8, atol=1e-3)
    for rows in (1, 2, 3, 5, 11):
        assert torch.equal(module.linear(x[:rows].contiguous(), packed, b, 130), together[:rows]), rows


@pytest.mark.slow
@pytest.mark.parametrize("kind", kernels.KINDS)
def test_each_build_the_cpu_lacks_still_compiles(kind):
    """A build this CPU cannot run is compiled anyway (every source to an object, unoptimized:
    syntax and types, and each intrinsic inlined under the build's flags, which a syntax check
    alone misses), so that a change made on one kind of machine cannot break another kind's
    build unseen."""
    if kernels.cpu_has(kind):
        pytest.skip("this CPU runs the build: test_each_build_the_cpu_supports_compiles_and_is_exact builds it")
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    for source in kernels.SOURCES[kind]:
        done = subprocess.run(["c++", "-std=c++17", *kernels.FLAGS[kind], "-O0", "-c", "-o", os.devnull, *includes,
                               "-DTORCH_EXTENSION_NAME=check", str(source)], capture_output=True, text=True)
        assert done.returncode == 0, f"{source.name} ({kind}):\n{done.stderr[-3000:]}"


def test_a_cpu_with_avx2_runs_a_kernel(kernel_module):
    """kernel() falls back to oneDNN or torch silently (a warning) when the build fails:
    on a CPU that has the instructions that is a failure (kernel_module fails with the
    build's error), and the kernel is the best build the CPU supports."""
    assert kernel_module.kind in kernels.KINDS and kernels.kernel_kind() == kernel_module.kind


LOAD_KERNEL = "import sys; from specdecode.models import kernels; kernels._build(sys.argv[1]); print('loaded')"
HOLD_LOCK = ("import fcntl, sys; held = open(sys.argv[1], 'a'); fcntl.flock(held, fcntl.LOCK_EX); "
             "print('held', flush=True); sys.stdin.readline()")  # held until told to let go


@pytest.fixture
def built_copy(kernel_module, tmp_path):
    """(kind, build folder, environment): a copy of this machine's built kernels under a
    home of its own, so that the locks these tests leave or hold touch no shared build."""
    kind = kernel_module.kind
    name = f"{kind}-{kernels.source_tag(kind)}"
    folder = tmp_path / "kernels" / name
    shutil.copytree(kernels.home() / "kernels" / name, folder)  # times kept: nothing to rebuild
    return kind, folder, {**os.environ, "SPECDECODE_HOME": str(tmp_path)}


def load_command(kind: str) -> list[str]:
    """A new process that loads the `kind` build and prints "loaded"."""
    return [sys.executable, "-c", LOAD_KERNEL, kind]


def output_until(pipe, text: str, seconds: float) -> str:
    """What a process wrote to `pipe` until `text` appeared, it stopped writing, or `seconds` passed."""
    seen, deadline = b"", time.monotonic() + seconds
    while text.encode() not in seen and (left := deadline - time.monotonic()) > 0:
        if not select.select([pipe], [], [], left)[0]:
            break
        chunk = os.read(pipe.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    return seen.decode(errors="replace")


def test_a_build_killed_midway_does_not_block_the_next_process(built_copy):
    """A build killed midway (Ctrl-C) leaves torch's lock file behind, on which the next
    process used to wait forever: the build lock is the OS's, so the leftover goes."""
    kind, folder, env = built_copy
    (folder / "lock").touch()
    done = subprocess.run(load_command(kind), capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]
    assert not (folder / "lock").exists()


def test_a_build_waits_for_another_process_building_and_says_so(built_copy):
    kind, folder, env = built_copy
    waiting = f"waiting for another process building the kernels in {folder}"
    with subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder / "build.lock")], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout.readline().strip() == "held"
        with subprocess.Popen(load_command(kind), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as loader:
            said = output_until(loader.stderr, waiting, 120)
            holder.stdin.write("\n")  # let go only once the loader has said that it waits
            holder.stdin.flush()
            out, err = loader.communicate(timeout=300)
    assert waiting in said, said[-2000:]
    assert loader.returncode == 0 and out.decode().strip() == "loaded", err.decode()[-2000:]


@pytest.mark.skipif(not onednn_should_pack_bf16(), reason="this CPU lacks AVX-512 (bw, vl, dq) and AVX-NE-CONVERT")
def test_onednn_packs_bf16_where_the_cpu_has_the_instructions():
    assert linear.onednn_packs_bf16()


def test_without_the_kernel_bf16_weights_go_to_onednn(monkeypatch):
    if not linear.onednn_packs_bf16():
        assert not onednn_should_pack_bf16()  # test_onednn_packs_bf16_where_the_cpu_has_the_instructions
        pytest.skip("this CPU lacks what oneDNN needs to pack bf16")
    monkeypatch.setattr(kernels, "kernel", lambda: None)
    w, b = weights(96, 64, seed=2)
    layer = Linear(w, b)
    assert layer.backend == "onednn"
    x = torch.randn(4, 64).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), w.float(), b.float()), rtol=2**-8, atol=1e-3)
    assert Linear(w.float(), b.float()).backend == "torch"


def test_without_a_kernel_where_onednn_cannot_pack_bf16_weights_go_to_f_linear(monkeypatch):
    """An AVX2-only CPU (AMD Zen 3) where the kernel did not build: oneDNN refuses to
    reorder bf16, F.linear still runs."""
    monkeypatch.setattr(kernels, "kernel", lambda: None)
    monkeypatch.setattr(linear, "onednn_packs_bf16", lambda: False)
    w, b = weights(96, 64, seed=3)
    layer = Linear(w, b)
    assert layer.backend == "torch" and not layer.packed
    x = torch.randn(4, 64).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), w.float(), b.float()), rtol=2**-8, atol=1e-3)


def test_an_unknown_kernel_choice_is_refused(monkeypatch):
    from specdecode.errors import SpecDecodeError

    monkeypatch.setenv(kernels.KERNEL_ENV, "fast")
    kernels.kernel.cache_clear()
    try:
        with pytest.raises(SpecDecodeError, match="SPECDECODE_KERNEL"):
            kernels.kernel()
    finally:
        monkeypatch.delenv(kernels.KERNEL_ENV)
        kernels.kernel.cache_clear()
