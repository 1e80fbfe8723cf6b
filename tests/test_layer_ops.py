"""The fused small ops of a bf16 layer (cpu_ops.cpp) against the torch ops they replace.

They round where the torch ops round, so the elementwise ones agree bitwise; the norm
sums squares in another order, so it may differ by a bf16 step or two where a row's sum
lands near a rounding boundary. The model-level check against transformers is test_native.py.
"""

import pytest
import torch

from specdecode.models import amx
from specdecode.models.layer_ops import FusedOps, TorchOps, layer_ops

pytestmark = pytest.mark.skipif(amx.kernel() is None, reason="the extension is not built on this machine")


def randn(*shape, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def test_bf16_models_use_the_fused_ops_and_fp32_models_torch():
    assert layer_ops(torch.bfloat16) is FusedOps and layer_ops(torch.float32) is TorchOps


def test_residual_add_rope_and_silu_are_bitwise_the_torch_ops():
    x, delta, weight = randn(3, 5, 96, scale=3), randn(3, 5, 96, seed=1), randn(96, seed=2).abs() + 0.5
    fused_sum, _ = FusedOps.add_rms_norm(x, delta, weight, 1e-6)
    torch_sum, _ = TorchOps.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(fused_sum, torch_sum)
    gate_up = randn(4, 2, 2 * 80, scale=4, seed=3)
    assert torch.equal(FusedOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up))
    heads, kv_heads, hd, T = 6, 2, 32, 5
    qkv = randn(1, T, (heads + 2 * kv_heads) * hd, seed=4)
    angles = torch.rand(T, hd, generator=torch.Generator().manual_seed(5)) * 6
    for cos, sin in [(angles.cos().bfloat16(), angles.sin().bfloat16()),  # positions (T,)
                     (angles.cos().bfloat16()[None], angles.sin().bfloat16()[None])]:  # positions (1, T)
        fused = FusedOps.rope_qkv(qkv, cos, sin, heads, kv_heads, hd)
        reference = TorchOps.rope_qkv(qkv, cos, sin, heads, kv_heads, hd)
        for a, b in zip(fused, reference):
            assert a.shape == b.shape and torch.equal(a, b)


def test_rms_norm_is_within_bf16_rounding_of_torch():
    x, weight = randn(64, 576, scale=5, seed=6), randn(576, seed=7).abs() + 0.5
    x[:, 3] *= 200  # an outlier feature, as real models have
    fused, reference = FusedOps.rms_norm(x, weight, 1e-5), TorchOps.rms_norm(x, weight, 1e-5)
    # one bf16 step in the normalised value can become two after the weight's product rounds
    torch.testing.assert_close(fused.float(), reference.float(), rtol=2**-6, atol=0)
    assert (fused != reference).float().mean() < 0.01
    rows = FusedOps.rms_norm(x[:1], weight, 1e-5)
    assert torch.equal(rows, fused[:1])  # a row does not depend on the others
