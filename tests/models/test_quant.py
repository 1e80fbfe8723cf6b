"""Quantized weights: the kernel's products against the `gguf` package's dequantizer, rows
independent of the row count (what keeps speculative output identical), and GGUF files
read under transformers' names."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.stopping import StopCondition
from specdecode.drafters import DraftModel, PromptLookup
from specdecode.errors import SpecDecodeError
from specdecode.models.native import NativeModel
from specdecode.models.quant import KERNEL_TYPES, X8_BYTES, QuantLinear, QuantTensor, kernel_layout, stacked_layouts
from tests.conftest import assert_verify_pass_equals_one_token_passes

FP16_FIELDS = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,)}  # byte offsets of scales


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """Random bytes in every field, with small finite fp16 scales: any bit pattern of the
    values is a valid block, so this reaches every code the kernel decodes."""
    values, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal((rows, cols // values)) * 0.01).astype(np.float16)
        raw[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    return QuantTensor.from_blocks(qtype, raw, rows)


def quantized_rows(x: torch.Tensor, block: int) -> np.ndarray:
    """Rows of x as the kernel quantizes them (8 bits per `block` values, nearest even), in float64."""
    x = x.float().numpy().reshape(-1, block)
    amax = np.abs(x).max(axis=1)
    iscale = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)), 0).astype(np.float32)
    q = np.rint(x * iscale[:, None])
    return (q * (amax / np.float32(127)).astype(np.float64)[:, None]).reshape(-1)


def reference(x: torch.Tensor, w: QuantTensor) -> np.ndarray:
    block = 256 if w.qtype in (T.Q4_K, T.Q6_K) else 32
    rows = np.stack([quantized_rows(r, block) for r in x])
    return rows @ w.dequantize().double().numpy().T


# 40 rows: Q4_K, Q6_K, Q8_0 and Q5_0 run repacked eight rows at a time; 42: as stored (kernel_layout)
@pytest.mark.parametrize("rows", [40, 42])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_kernel_product_matches_the_dequantized_blocks(qtype, rows, kernel_module):
    w = random_blocks(qtype, rows, 512)
    data = kernel_layout(w)
    assert data.shape[-1] == (X8_BYTES[qtype] if qtype in X8_BYTES and rows % 8 == 0 else GGML_QUANT_SIZES[qtype][1])
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = kernel_module.quant_linear(x, [data], None, rows).float().numpy()
    want = reference(x, w)
    # the integer sums are exact; what remains is fp32 accumulation and the bf16 output
    assert np.abs(y - want).max() <= 1e-2 * np.abs(want).max()
    y32 = kernel_module.quant_linear(x.float(), [data], None, rows).double().numpy()
    assert np.abs(y32 - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("inputs", [1, 2])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_few_row_products_over_many_groups_match_the_dequantized_blocks(qtype, inputs, kernel_module):
    """A decoding step's product reads several groups of eight rows side by side where the
    build does so (the AVX2 build's WEIGHT_STREAMS): 17 groups give each of two threads whole
    sets of four and one left over."""
    w = random_blocks(qtype, 136, 512, seed=4)
    x = torch.randn(inputs, 512, generator=torch.Generator().manual_seed(5))
    y = kernel_module.quant_linear(x, [kernel_layout(w)], None, 136).double().numpy()
    want = reference(x, w)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("rows", [72, 70])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_each_row_is_bitwise_its_one_row_product(qtype, rows, kernel_module):
    data = kernel_layout(random_blocks(qtype, rows, 512, seed=2))
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([kernel_module.quant_linear(x[i:i + 1], [data], None, rows) for i in range(17)])
    for count in (2, 3, 4, 8, 11, 17):  # verify passes of 1-3 drafts, and chunks of eight rows
        assert torch.equal(kernel_module.quant_linear(x[:count], [data], None, rows), alone[:count])


@pytest.mark.parametrize("rows", [24, 26])  # 24: the repacked types repacked; 26: every type as stored
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_long_passes_are_bitwise_one_row_products(qtype, rows, kernel_module):
    """A prefill's many rows run tiled (64 rows, and for repacked blocks 4096 values, at a
    time): 130 rows make three tiles of rows, 17 x 256 values two of values, and each row
    is still its one-row product."""
    cols = 17 * 256
    data = kernel_layout(random_blocks(qtype, rows, cols, seed=7))
    x = torch.randn(130, cols, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    alone = torch.cat([kernel_module.quant_linear(x[i:i + 1], [data], None, rows) for i in range(130)])
    for count in (32, 64, 130):
        assert torch.equal(kernel_module.quant_linear(x[:count], [data], None, rows), alone[:count])


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_every_build_this_cpu_runs_gives_the_same_products(qtype, kernel_module):
    """VNNI's VPDPBUSD (AVX-512 and AMX builds) and AVX2's PMADDUBSW + PMADDWD reach the
    same integer sums, so every build gives bitwise the same output: a quantized model
    decodes alike on every kind of CPU that runs it."""
    from specdecode.models import kernels

    kinds = [kind for kind in kernels.KINDS if kernels.cpu_has(kind)]
    if len(kinds) < 2:
        pytest.skip(f"this CPU runs one build only ({', '.join(kinds)})")
    data = kernel_layout(random_blocks(qtype, 64, 17 * 256, seed=9))
    x = torch.randn(40, 17 * 256, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    for count in (1, 2, 3, 4, 5, 9, 40):
        products = {kind: kernels._build(kind).quant_linear(x[:count], [data], None, 64) for kind in kinds}
        for kind, y in products.items():
            assert torch.equal(y, products[kinds[0]]), (kind, kinds[0], count)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_repacked_32_value_blocks_take_widths_no_multiple_of_256(qtype, kernel_module):
    """Qwen2.5-0.5B's width (896) is 3.5 blocks of 256: its GGUF stores Q5_0 and Q8_0, which
    run repacked eight rows at a time, one block of 32 values after another."""
    w = random_blocks(qtype, 24, 896, seed=11)
    data = kernel_layout(w)
    assert data.shape == (3, 28, X8_BYTES[qtype])
    x = torch.randn(9, 896, generator=torch.Generator().manual_seed(12))
    y = kernel_module.quant_linear(x, [data], None, 24).double().numpy()
    want = reference(x, w)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    alone = torch.cat([kernel_module.quant_linear(x[i:i + 1], [data], None, 24) for i in range(9)])
    assert torch.equal(kernel_module.quant_linear(x, [data], None, 24), alone)


def test_stacked_parts_of_mixed_types_equal_their_products_side_by_side(kernel_module):
    parts = [random_blocks(T.Q4_K, 48, 512, 4), random_blocks(T.Q6_K, 16, 512, 5), random_blocks(T.Q4_K, 16, 512, 6)]
    bias = torch.randn(80).to(torch.bfloat16)
    layer = QuantLinear(parts, bias)
    assert layer.types == ["Q4_K", "Q6_K", "Q4_K"] and layer.out_features == 80
    x = torch.randn(3, 512).to(torch.bfloat16)
    apart = torch.cat([kernel_module.quant_linear(x.float(), [kernel_layout(p)], None, p.shape[0]) for p in parts],
                      dim=1)
    assert torch.equal(layer(x), (apart + bias.float()).to(torch.bfloat16))


def test_inputs_and_outputs_convert_as_torch_converts_them(kernel_module):
    # bf16 inputs are widened, and outputs rounded back with the bias added, inside the call:
    # bitwise torch's x.float(), y + bias and .to(bfloat16), for any width (20 + 24 outputs
    # leave a tail past the last eight) and for inputs that arrive in pieces
    parts = [random_blocks(T.Q4_K, 20, 768, 21), random_blocks(T.Q6_K, 24, 768, 22)]
    layouts = [kernel_layout(p) for p in parts]
    bias = torch.randn(44, generator=torch.Generator().manual_seed(23))
    x = torch.randn(37, 768, generator=torch.Generator().manual_seed(24)) * 40
    fp32 = kernel_module.quant_linear(x.bfloat16().float(), layouts, None, 44)
    assert fp32.dtype == torch.float32
    assert torch.equal(kernel_module.quant_linear(x.bfloat16().float(), layouts, bias, 44), fp32 + bias)
    from_bf16 = kernel_module.quant_linear(x.bfloat16(), layouts, bias, 44)
    assert from_bf16.dtype == torch.bfloat16 and torch.equal(from_bf16, (fp32 + bias).bfloat16())
    assert torch.equal(kernel_module.quant_linear(x.bfloat16(), layouts, bias.bfloat16(), 44),
                       (fp32 + bias.bfloat16().float()).bfloat16())
    wide = torch.cat([x, x], dim=1).bfloat16()[:, ::2]  # not contiguous
    assert torch.equal(kernel_module.quant_linear(wide, layouts, None, 44),
                       kernel_module.quant_linear(wide.contiguous(), layouts, None, 44))


@pytest.mark.parametrize("rows", [(16, 24), (4, 4)])  # whole groups of eight; parts that only fill one merged
def test_layouts_made_ahead_stack_to_the_layout_of_the_stacked_blocks(rows):
    plain = [random_blocks(T.Q4_K, n, 512, seed) for seed, n in enumerate(rows)]
    ahead = [QuantTensor(p.qtype, p.data, None if kernel_layout(p) is p.data else kernel_layout(p)) for p in plain]
    merged = kernel_layout(QuantTensor(T.Q4_K, torch.cat([p.data for p in plain])))
    for parts in (plain, ahead):
        [(qtype, layout)] = stacked_layouts(parts)
        assert qtype == T.Q4_K and torch.equal(layout, merged)


def test_quantize_refuses_rows_the_blocks_do_not_divide():
    with pytest.raises(SpecDecodeError, match="multiple of 32"):
        QuantTensor.quantize(torch.randn(4, 40), T.Q8_0)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_verify_pass_equals_one_token_passes(tiny_llama, quant, kernel_module):
    model = NativeModel.from_folder(tiny_llama, torch.bfloat16, quant)
    assert all(isinstance(m, QuantLinear) for layer in model.layers for m in layer.matrices)
    assert_verify_pass_equals_one_token_passes(model, (1, 4, 9))


def test_quantized_greedy_speculation_is_identical_to_plain_decoding(tiny_llama, tiny_llama_other, kernel_module):
    target = NativeModel.from_folder(tiny_llama, torch.bfloat16, "q4_0")
    same = NativeModel.from_folder(tiny_llama, torch.bfloat16, "q8_0")  # a close drafter, not the same numbers
    other = NativeModel.from_folder(tiny_llama_other, torch.bfloat16, "q8_0")
    prompt, stop = [5, 17, 42, 8, 17, 42, 8, 91, 5, 17, 42], StopCondition(max_new_tokens=40)
    plain, _ = collect(decode(target, prompt, stop))
    for drafter in (DraftModel(same, target.vocab_size), DraftModel(other, target.vocab_size), PromptLookup()):
        for k in (2, 5):
            assert collect(decode(target, prompt, stop, drafter=drafter, k=k))[0] == plain


@pytest.mark.real
def test_smollm2_gguf_blocks_are_the_converted_weights_exactly(smollm2_folder):
    """The file's Q4_1 and Q8_0 blocks, read under transformers' names with the rope rows
    put back in order, dequantize to exactly what transformers' GGUF loader made of them."""
    from safetensors.torch import load_file

    from specdecode.models.config import ModelConfig
    from specdecode.models.gguf_weights import load_gguf_weights
    from specdecode.models.store import ensure_weights, gguf_file

    weights = load_gguf_weights(gguf_file(smollm2_folder), ModelConfig.from_folder(smollm2_folder))
    converted = load_file(ensure_weights(smollm2_folder, "fp32"))
    assert set(weights) == set(converted)
    assert {w.qtype.name for w in weights.values() if isinstance(w, QuantTensor)} == {"Q4_1", "Q8_0"}
    for name, tensor in weights.items():
        values = tensor.dequantize() if isinstance(tensor, QuantTensor) else tensor
        assert torch.equal(values, converted[name].reshape(values.shape)), name


@pytest.mark.real
def test_a_prepared_gguf_gives_the_files_weights_and_is_made_again_when_damaged(smollm2_folder, caplog):
    """The prepared copy (prepared.py) maps to the same bytes as reading the GGUF, each layout
    the repack of its blocks, so the model's logits are bitwise the same; a damaged copy is
    replaced with a warning, and an older copy of the file is removed."""
    from specdecode.models.config import ModelConfig
    from specdecode.models.gguf_weights import load_gguf_weights
    from specdecode.models.prepared import load_prepared, prepared_path
    from specdecode.models.store import gguf_file

    config, gguf = ModelConfig.from_folder(smollm2_folder), gguf_file(smollm2_folder)
    path = prepared_path(gguf, smollm2_folder)
    path.unlink(missing_ok=True)
    key = path.name.removesuffix(".prepared.pt").rsplit(".", 1)[0]
    older = path.with_name(key + ".000000000000.prepared.pt")
    neighbour = path.with_name(key + ".5-other.000000000000.prepared.pt")  # another file, its name sharing a prefix
    neighbour.write_bytes(b"another file's copy")
    older.write_bytes(b"an older copy")
    try:
        made = load_prepared(gguf, config, smollm2_folder)
        assert path.is_file() and not older.exists() and neighbour.exists()
    finally:  # the model's folder is the user's cache: nothing of the test's left there
        for planted in (neighbour, older):
            planted.unlink(missing_ok=True)
    mapped, read = load_prepared(gguf, config, smollm2_folder), load_gguf_weights(gguf, config)
    assert set(made) == set(mapped) == set(read)
    layouts = 0
    for name, tensor in read.items():
        if not isinstance(tensor, QuantTensor):
            assert torch.equal(mapped[name], tensor), name
            continue
        assert mapped[name].qtype == tensor.qtype and torch.equal(mapped[name].data, tensor.data), name
        if mapped[name].layout is not None:
            assert torch.equal(mapped[name].layout, kernel_layout(tensor)), name
            layouts += 1
    assert layouts > 0
    tokens = torch.tensor([[1, 17, 42, 8, 91, 5]])
    models = [NativeModel(config, weights) for weights in (read, mapped)]
    logits = [m(tokens, m.new_cache(1, 16), num_logits=6).logits for m in models]
    assert torch.equal(logits[0], logits[1])
    path.write_bytes(b"not a saved dictionary")
    with caplog.at_level("WARNING", logger="specdecode"):
        again = load_prepared(gguf, config, smollm2_folder)
    assert "unreadable" in caplog.text and set(again) == set(read)
    assert torch.load(path, mmap=True, weights_only=True)["format"] == 1


def test_a_gguf_in_a_folder_of_the_users_is_prepared_under_the_cache(tmp_path, monkeypatch):
    from specdecode.models.prepared import prepared_path

    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "mine" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    first = prepared_path(gguf, gguf.parent)
    assert first.parent == tmp_path / "home" / "prepared" and first.name.startswith("model-")
    gguf.write_bytes(b"GGUF, changed")
    assert prepared_path(gguf, gguf.parent) != first  # a changed file is prepared anew


@pytest.mark.real
def test_smollm2_gguf_prompt_lookup_is_greedy_identical(smollm2_folder):
    from transformers import AutoTokenizer

    from specdecode.core.prompts import encode_prompt

    model = NativeModel.from_folder(smollm2_folder, torch.bfloat16, "gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder))
    prompt = encode_prompt(tokenizer, "Add type hints to this function:\ndef area(width, height):\n"
                                      "    return width * height\n")
    stop = StopCondition(max_new_tokens=48)
    plain, _ = collect(decode(model, prompt, stop))
    for k in (2, 6):
        lookup, done = collect(decode(model, prompt, stop, drafter=PromptLookup(), k=k))
        assert lookup == plain and done.stats.accepted_tokens > 0


def test_quality_compares_a_quantized_model_with_its_float_one(tiny_llama, kernel_module):
    from specdecode.commands.quality import compare

    reference = NativeModel.from_folder(tiny_llama, torch.bfloat16)
    chunks = [torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    same = compare(reference, reference, chunks)
    assert same["positions"] == 78 and same["top1_agreement"] == 1.0 and same["max_abs_logit_diff"] == 0.0
    assert same["mean_kl"] == pytest.approx(0.0, abs=1e-6)
    eight, four = (compare(reference, NativeModel.from_folder(tiny_llama, torch.bfloat16, q), chunks)
                   for q in ("q8_0", "q4_0"))
    assert 0 < eight["mean_kl"] < four["mean_kl"]  # fewer bits, further from the float model
    assert eight["top1_agreement"] >= four["top1_agreement"] and eight["top1_agreement"] > 0.8
