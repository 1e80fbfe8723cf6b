"""The native forward against transformers on the same weights, and its cache moves.

Tolerances, per dtype:
- fp32: |native - transformers| <= 2e-4 absolute on logits (observed: 0 to 5e-5; the
  two differ only in attention kernels and summation order).
- bf16: rounding to bf16 at every layer moves logits far more than the implementation
  does, so native bf16 is compared with the fp32 reference and must be about as close to it
  as transformers' own bf16 run: error <= 1.5 x transformers' bf16 error + 0.05, and the
  argmax agrees with fp32 wherever fp32's top-2 margin exceeds twice that error bound.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode.models.native import NativeModel
from tests.conftest import assert_verify_pass_equals_one_token_passes, require_kernel, save_tiny

PROMPT = [[3, 17, 42, 8, 91, 5, 23, 66, 12, 7, 50, 2]]


def hf_logits(folder, dtype, ids, hidden=False):
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=hidden)
    return out


def check_against_transformers(folder, ids):
    reference = hf_logits(folder, torch.float32, ids, hidden=True)
    native32 = NativeModel.from_folder(folder, torch.float32)
    layers = native32.config.num_layers
    out = native32(torch.tensor(ids), native32.new_cache(), hidden_layers=(0, 1, layers))
    assert (out.logits - reference.logits).abs().max() <= 2e-4
    for i in (0, 1, layers):
        assert (out.hidden_states[i] - reference.hidden_states[i]).abs().max() <= 2e-4

    hf_bf16 = hf_logits(folder, torch.bfloat16, ids).logits.float()
    native16 = NativeModel.from_folder(folder, torch.bfloat16)
    logits16 = native16(torch.tensor(ids), native16.new_cache()).logits
    bound = 1.5 * (hf_bf16 - reference.logits).abs().max() + 0.05
    assert (logits16 - reference.logits).abs().max() <= bound
    top2 = reference.logits.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * bound
    assert torch.equal(logits16.argmax(-1)[clear], reference.logits.argmax(-1)[clear])


def test_tiny_llama_matches_transformers(tiny_llama):
    check_against_transformers(tiny_llama, PROMPT)


def test_tiny_qwen2_matches_transformers(tiny_qwen2):
    check_against_transformers(tiny_qwen2, PROMPT)


def test_tiny_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = save_tiny(tmp_path, "llama", seed=3, rope_parameters=rope)
    check_against_transformers(folder, [list(range(1, 90))])


@pytest.mark.real
def test_smollm2_matches_transformers(smollm2_folder):
    check_against_transformers(smollm2_folder, [[1, 504, 3154, 314, 216, 1345, 28, 49, 30, 9427, 282, 1250]])


def test_a_long_pass_in_chunks_matches_transformers(tiny_llama, monkeypatch):
    """A prompt longer than a chunk runs as passes of PREFILL_CHUNK tokens over the cache:
    every row's logits and hidden states still match transformers' one pass."""
    from specdecode.models import native

    monkeypatch.setattr(native, "PREFILL_CHUNK", 16)
    check_against_transformers(tiny_llama, [[(7 * i) % 97 + 1 for i in range(53)]])  # four chunks, the last short
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    ids = torch.tensor([[(5 * i) % 89 + 1 for i in range(40)]])
    all_rows = model(ids, model.new_cache()).logits
    for wanted in (1, 3, 30):  # logits of the last rows only, across chunk borders (fp32 products
        # round by row count, slightly)
        last = model(ids, model.new_cache(), num_logits=wanted).logits
        assert last.shape[1] == wanted and torch.allclose(last, all_rows[:, -wanted:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("quant", [None, "q8_0"])
def test_greedy_speculation_after_a_chunked_prefill_is_plain_decoding(tiny_llama, quant, monkeypatch):
    from specdecode.core.engine import decode
    from specdecode.core.events import collect
    from specdecode.core.stopping import StopCondition
    from specdecode.drafters import PromptLookup
    from specdecode.models import native

    if quant is not None:
        require_kernel()
    monkeypatch.setattr(native, "PREFILL_CHUNK", 16)
    model = NativeModel.from_folder(tiny_llama, torch.bfloat16, quant)
    prompt = [(3 * i) % 23 + 2 for i in range(70)]  # repetitive: prompt lookup finds matches
    stop = StopCondition(max_new_tokens=30)
    plain, _ = collect(decode(model, prompt, stop))
    for k in (2, 6):
        assert collect(decode(model, prompt, stop, drafter=PromptLookup(), k=k))[0] == plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewind_and_compact_then_continue_equals_recompute(tiny_qwen2, dtype):
    model = NativeModel.from_folder(tiny_qwen2, dtype)
    seq = torch.tensor(PROMPT)
    full = model(seq, model.new_cache()).logits  # (1, 12, V), from scratch

    cache = model.new_cache()
    model(seq[:, :6], cache)
    model(torch.tensor([[1, 2, 3]]), cache)  # a rejected draft of three tokens
    cache.rewind(3)
    out = model(seq[:, 6:], cache).logits
    torch.testing.assert_close(out, full[:, 6:], rtol=0, atol=1e-5 if dtype == torch.float32 else 0)

    # A tree: after seq[:6], nodes [seq6, x, seq7, seq8] where x is a sibling of seq7's path
    # branch (both children of seq6). Verify in one pass, keep the path seq6 -> seq7 -> seq8.
    cache = model.new_cache()
    model(seq[:, :6], cache)
    nodes = torch.tensor([[int(seq[0, 6]), 77, int(seq[0, 7]), int(seq[0, 8])]])
    positions = torch.tensor([6, 7, 7, 8])
    parent_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 6, dtype=torch.bool), parent_mask], dim=1)
    tree = model(nodes, cache, positions=positions, mask=mask).logits
    torch.testing.assert_close(tree[:, [0, 2, 3]], full[:, 6:9], rtol=0, atol=1e-4 if dtype == torch.float32 else 0.07)
    cache.compact([6, 8, 9])
    assert cache.length == 9
    out = model(seq[:, 9:], cache).logits
    torch.testing.assert_close(out, full[:, 9:], rtol=0, atol=1e-4 if dtype == torch.float32 else 0.07)


def test_bf16_verify_pass_equals_one_token_passes(tiny_llama, bf16_path):
    """Batch invariance: k+1 tokens in one pass give bit-identical logits to k+1 single passes."""
    assert_verify_pass_equals_one_token_passes(NativeModel.from_folder(tiny_llama, torch.bfloat16), (1, 3, 8))


@pytest.mark.slow
def test_bf16_attention_rows_equal_one_row_calls_at_smollm2_head_shapes():
    """torch's bf16 attention at SmolLM2's shapes (9 heads over 3 key-value heads of 64): with
    the rows of a pass folded into one length, a row now and then got other bits than a
    one-row pass (a SmolLM2 verify pass flipped a greedy token on an AVX2 CPU; native._attend)."""
    from specdecode.models.kv_cache import KVCache
    from specdecode.models.native import additive_mask

    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator).bfloat16()
    slots = torch.arange(512)
    for trial in range(60):
        T = 2 + trial % 7
        past_k, past_v, q, k, v = randn(1, 3, 20, 64), randn(1, 3, 20, 64), randn(1, 9, T, 64), randn(1, 3, T, 64), randn(1, 3, T, 64)
        cache = KVCache(1, 1, 3, 512, 64, torch.bfloat16)
        cache.write(0, past_k, past_v)
        cache.advance(20)
        allowed = slots[None, :] <= 20 + torch.arange(T)[:, None]  # causal over the new rows
        together = NativeModel._attend(q, k, v, cache, 0, additive_mask(allowed[None], torch.bfloat16), 3)
        for row in range(T):
            cache.length = 20 + row
            alone = NativeModel._attend(q[:, :, row:row + 1], k[:, :, row:row + 1], v[:, :, row:row + 1], cache, 0,
                                        additive_mask(allowed[None, row:row + 1], torch.bfloat16), 3)
            assert torch.equal(together[:, :, row], alone[:, :, 0]), (trial, row)


@pytest.mark.parametrize("quant", [None, "q8_0", "q4_0"])  # bf16 weights, or quantized ones (quant_linear.cpp)
@pytest.mark.parametrize("folder", ["tiny_llama", "tiny_qwen2"])  # qwen2: q/k/v biases
def test_every_layer_in_one_call_is_bitwise_the_kernels_one_by_one(folder, quant, request, kernel_module):
    from specdecode.core.trees import build_tree, tree_attention

    model = NativeModel.from_folder(request.getfixturevalue(folder), torch.bfloat16, quant)
    assert model.layer_in_one_call
    results = {}
    for one_call in (True, False):
        model.layer_in_one_call = one_call
        cache = model.new_cache()
        model(torch.tensor(PROMPT), cache)
        chain = model(torch.tensor([[4, 9, 33]]), cache, hidden_layers=(1, 2))
        tree = build_tree([(0,), (1,), (0, 0), (1, 0)])
        positions, mask = tree_attention(tree, cache.length)
        branched = model(torch.tensor([[5, 6, 7, 8, 9]]), cache, positions=positions, mask=mask)
        results[one_call] = [chain.logits, chain.hidden_states[1], chain.hidden_states[2], branched.logits,
                             cache.keys[:, :, :, :cache.length], cache.values[:, :, :, :cache.length]]
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


def test_mask_shape_is_checked(tiny_llama):
    model = NativeModel.from_folder(tiny_llama, torch.float32)
    with pytest.raises(ValueError, match="mask"):
        model(torch.tensor([[1, 2]]), model.new_cache(), mask=torch.ones(2, 5, dtype=torch.bool))
