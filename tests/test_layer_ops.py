"""The fused small ops of a bf16 layer (ops.cpp) against the torch ops they replace.

They round where the torch ops round, so the elementwise ones agree bitwise; the norm
sums squares in another order, so it may differ by a bf16 step or two where a row's sum
lands near a rounding boundary. The model-level check against transformers is test_native.py.
"""

import pytest
import torch

from specdecode.models.layer_ops import FusedOps, TorchOps, layer_ops

# skips only on a CPU without the kernel's instructions; a failed build fails (conftest.require_kernel)
pytestmark = pytest.mark.usefixtures("kernel_module")


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
    row = FusedOps.silu_mul(gate_up[:1, :1])
    assert torch.equal(row, FusedOps.silu_mul(gate_up)[:1, :1])  # a row does not depend on the others
    wide = randn(1, 12, 2 * 4096, scale=4, seed=4)  # rows enough to be split between threads
    assert torch.equal(FusedOps.silu_mul(wide), TorchOps.silu_mul(wide))
    assert torch.equal(torch.cat([FusedOps.silu_mul(wide[:, i:i + 1]) for i in range(12)], dim=1),
                       FusedOps.silu_mul(wide))


def test_silu_is_the_torch_op_wherever_its_exp_is_not_clamped():
    # the kernel's exp stops at exp(-87): below it silu(g) is about 1e-36 instead of 0 or
    # a subnormal, which nothing downstream can tell apart
    gate_up = randn(64, 2 * 1000, scale=30, seed=8)  # 0.4% of the gates below -87
    fused, reference = FusedOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up)
    unclamped = gate_up[..., :1000] > -87
    assert (~unclamped).any()
    assert torch.equal(fused[unclamped], reference[unclamped])
    assert fused[~unclamped].abs().max() < 1e-30
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


def reference_attention(qkv, keys, values, allowed, heads, kv_heads):
    """fp32 attention of each row of qkv over the cache slots `allowed` lets it see."""
    B, T, _ = qkv.shape
    hd = keys.shape[-1]
    q = qkv[..., : heads * hd].float().view(B, T, heads, hd).transpose(1, 2)  # (B, nh, T, hd)
    k = keys.float().repeat_interleave(heads // kv_heads, dim=1)[:, :, : allowed.shape[-1]]
    v = values.float().repeat_interleave(heads // kv_heads, dim=1)[:, :, : allowed.shape[-1]]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    return out.transpose(1, 2).reshape(B, T, heads * hd)


def test_cache_attention_writes_the_cache_and_attends_like_torch():
    heads, kv_heads, hd, start, T = 6, 2, 32, 40, 5
    qkv = randn(2, T, (heads + 2 * kv_heads) * hd, seed=6)
    keys, values = randn(2, kv_heads, 64, hd, seed=7), randn(2, kv_heads, 64, hd, seed=8)
    causal = torch.ones(T, start + T, dtype=torch.bool).tril(start)[None].expand(2, -1, -1)
    tree = causal.clone()
    tree[:, 3, start + 1: start + 3] = False  # row 3 sees the prefix, row 0 and itself
    for allowed in (None, causal.contiguous(), tree.contiguous()):
        k, v = keys.clone(), values.clone()
        out = FusedOps.cache_attention(qkv, k, v, start, allowed, heads, kv_heads)
        new_k = qkv[..., heads * hd: (heads + kv_heads) * hd].view(2, T, kv_heads, hd).transpose(1, 2)
        assert torch.equal(k[:, :, start: start + T], new_k) and torch.equal(k[:, :, :start], keys[:, :, :start])
        expected = reference_attention(qkv, k, v, causal if allowed is None else allowed, heads, kv_heads)
        assert (out.float() - expected).abs().max() < 0.02  # bf16 output, one rounding
    assert not torch.equal(out, FusedOps.cache_attention(qkv, keys.clone(), values.clone(), start, None, heads,
                                                         kv_heads))  # the tree row differs indeed


def test_cache_attention_rows_depend_only_on_the_keys_they_see_in_order():
    """What makes a bf16 tree pass bitwise plain decoding: a row's output is the same
    whether its keys sit in consecutive slots or with gaps, and whatever other rows the
    call has."""
    heads, kv_heads, hd = 4, 1, 64
    width = (heads + 2 * kv_heads) * hd
    prefix, rows = 30, randn(1, 4, width, seed=9)  # rows 0 and 3 form a path; 1, 2 are siblings
    cache_k, cache_v = randn(1, kv_heads, 64, hd, seed=10), randn(1, kv_heads, 64, hd, seed=11)
    # a chain: rows 0, 3 at slots prefix, prefix + 1
    chain = FusedOps.cache_attention(rows[:, [0, 3]].contiguous(), cache_k.clone(), cache_v.clone(), prefix, None,
                                     heads, kv_heads)
    # a tree: all four rows at slots prefix .. prefix + 3, row 3 seeing row 0 and itself only
    allowed = torch.ones(1, 4, prefix + 4, dtype=torch.bool)
    allowed[0, :, prefix:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    tree = FusedOps.cache_attention(rows, cache_k.clone(), cache_v.clone(), prefix, allowed, heads, kv_heads)
    assert torch.equal(tree[:, 0], chain[:, 0]) and torch.equal(tree[:, 3], chain[:, 1])
    # one row at a time
    one = FusedOps.cache_attention(rows[:, :1].contiguous(), cache_k.clone(), cache_v.clone(), prefix, None,
                                   heads, kv_heads)
    assert torch.equal(one[:, 0], tree[:, 0])
