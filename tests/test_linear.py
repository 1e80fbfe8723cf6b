"""The bf16 linear layer: this machine's kernel (AMX or AVX2) against F.linear, and its
rows' independence.

Greedy identity in bf16 rests on this: a verify pass over many tokens must give each
token bitwise the product of a one-token pass. Both kernels compute every row with the
same instructions in the same order, so that holds for any number of rows; oneDNN's
packed product holds it up to 11 rows only.
"""

import pytest
import torch
import torch.nn.functional as F

from specdecode.models import kernels
from specdecode.models import linear
from specdecode.models.linear import Linear

needs_kernel = pytest.mark.skipif(kernels.kernel() is None, reason="no kernel (AMX or AVX2) on this machine")
needs_onednn_bf16 = pytest.mark.skipif(not linear.onednn_packs_bf16(), reason="oneDNN cannot pack bf16 on this CPU")


def weights(out_features: int, in_features: int, seed: int, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    return w, b


@needs_kernel
@pytest.mark.parametrize("shape", [(2048, 1536), (576, 1536), (100, 40), (64, 32), (7, 70)])
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


@pytest.mark.skipif(not kernels.cpu_has("avx2") or kernels.kernel_kind() == "avx2",
                    reason="no AVX2, or the tests above already run the AVX2 build")
def test_avx2_build_on_a_cpu_that_runs_the_amx_build():
    """The AVX2 build stays compiled and exact where CI runs the AMX one (a minute's build)."""
    module = kernels._build("avx2")
    w, b = weights(130, 100, seed=4)
    packed = kernels._pack_avx2(w)
    x = torch.randn(20, 100).bfloat16()
    together = module.linear(x, packed, b, 130)
    torch.testing.assert_close(together.float(), F.linear(x.float(), w.float(), b.float()), rtol=2**-8, atol=1e-3)
    for rows in (1, 2, 3, 11):
        assert torch.equal(module.linear(x[:rows].contiguous(), packed, b, 130), together[:rows]), rows


@needs_onednn_bf16
def test_without_the_kernel_bf16_weights_go_to_onednn(monkeypatch):
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
