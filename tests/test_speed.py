"""`specdecode speed`: the decoding rate is timed apart from the prompt's prefill, on both
sides, measured against generators whose prefill and steps take known times."""

from __future__ import annotations

import time

import pytest

from specdecode.commands import speed
from specdecode.commands.speed import Timing, format_speed, run_speed
from specdecode.core.events import Done, Round, Stats
from specdecode.errors import SpecDecodeError

PREFILL_S, STEP_S = 0.3, 0.02  # the fakes' prefill and one decoding step
SLACK_S = 0.09  # what a sleep may overshoot by on a busy machine: less than the prefill or 5 steps


def test_timing_splits_the_first_token_from_the_decoding_rate():
    t = Timing(prefill_s=1.0, decode_s=2.0, new_tokens=5)
    assert t.tokens_per_s == 2.0  # tokens 2..5 in the 2 s after the first
    assert t.end_to_end_tokens_per_s == pytest.approx(5 / 3)


def test_native_timing_measures_the_prefill_apart_from_the_steps(monkeypatch):
    def slow_decode(model, prompt_ids, stop):  # a prefill, then one token per step
        time.sleep(PREFILL_S)
        yield Round((1,), 0, 0)
        for _ in range(stop.max_new_tokens - 1):
            time.sleep(STEP_S)
            yield Round((1,), 0, 0)
        yield Done("length", Stats())

    monkeypatch.setattr(speed, "decode", slow_decode)
    t = speed._time_native(None, [1, 2, 3], 6)
    assert t.new_tokens == 6
    assert PREFILL_S <= t.prefill_s < PREFILL_S + SLACK_S  # sleeps overshoot, never undershoot
    assert 5 * STEP_S <= t.decode_s < 5 * STEP_S + SLACK_S  # the prefill is not in the rate


def test_transformers_timing_measures_the_prefill_apart_from_the_steps():
    import torch

    class SlowGenerate:  # streams like transformers: the prompt, then each new token
        def generate(self, ids, max_new_tokens, streamer, **_):
            streamer.put(ids)
            time.sleep(PREFILL_S)
            streamer.put(torch.tensor([1]))
            for _ in range(max_new_tokens - 1):
                time.sleep(STEP_S)
                streamer.put(torch.tensor([1]))
            streamer.end()
            return torch.cat([ids, torch.ones(1, max_new_tokens, dtype=ids.dtype)], dim=1)

    t = speed._time_transformers(SlowGenerate(), [1, 2, 3], 6)
    assert PREFILL_S <= t.prefill_s < PREFILL_S + SLACK_S
    assert 5 * STEP_S <= t.decode_s < 5 * STEP_S + SLACK_S


@pytest.mark.parametrize("words", [8, 1000, 4096 * 16 + 24, 3 * 2**20 + 8])
def test_the_kernels_read_of_memory_in_streams_reads_every_byte_once(kernel_module, words):
    """The bandwidth read must touch the whole buffer, tails included, or its rate would be
    too high: its checksum equals torch's sum, for every stream count and buffer size."""
    import torch

    values = torch.randint(-2**40, 2**40, (words,), dtype=torch.int64, generator=torch.Generator().manual_seed(words))
    for streams in speed.STREAMS + (3, 64):
        assert kernel_module.read_streams(values, streams) == int(values.sum())
    with pytest.raises(RuntimeError, match="streams"):
        kernel_module.read_streams(values, 0)


CHAINS = 12  # peak.cpp's chains a thread


def wrapped(value: int, bits: int) -> int:
    return (value + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)


@pytest.mark.parametrize("quantized", [True, False])
def test_the_peak_loop_performs_every_multiply_add_it_counts(kernel_module, quantized):
    """The rate is work over time: the checksum of every chain on every thread must be what
    the instruction computes over all the steps counted (a loop the compiler shortened
    would report a peak no product reaches, and a floor that is no floor)."""
    import torch

    steps, threads = 1_000_003, torch.get_num_threads()
    rate, checksum = kernel_module.multiply_add_peak(quantized, steps)
    vnni = kernel_module.kind in ("avx512", "amx")
    if quantized:  # inputs 1 (unsigned) times c + 1 (signed), summed in lanes that wrap
        lanes, per_lane, bits = (16, 4, 32) if vnni else (16, 2, 16)  # VPDPBUSD's int32 or VPMADDUBSW's int16
        chains = CHAINS if vnni else 7  # AVX2's registers hold seven chains and their inputs
        expected = threads * sum(lanes * wrapped(steps * per_lane * (c + 1), bits) for c in range(chains))
    else:  # 1 x 1 into fp32 lanes: 16 lanes of two products (VDPBF16PS) or 8 FMAs
        expected = threads * CHAINS * (32 if vnni else 8) * steps
    assert checksum == expected and rate > 0
    with pytest.raises(RuntimeError, match="iterations"):
        kernel_module.multiply_add_peak(quantized, 2 ** 24 + 1)  # fp32 chains would round past it


def test_no_product_outruns_the_peak_its_floor_is_taken_from(kernel_module):
    """The floor is a floor only if every product's multiply-adds run at most at the peak
    measured: sixteen rows through a matrix in cache (bound by arithmetic, not memory), at
    the fastest of many runs, stay under it. With AMX no peak is reported: its tiles run
    far faster than the instruction timed."""
    import torch
    from gguf import GGMLQuantizationType as T

    from specdecode.models.linear import Linear
    from specdecode.models.quant import QuantLinear
    from tests.models.test_quant import random_blocks

    peaks = speed.measure_multiply_add_peaks()
    if kernel_module.kind == "amx":
        assert peaks == {}
        return
    x = torch.randn(16, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weight = (torch.randn(1024, 4096, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    products = {"quant": QuantLinear([random_blocks(T.Q4_K, 1024, 4096)]), kernel_module.kind: Linear(weight)}
    for backend, product in products.items():
        assert product.backend == backend
        product(x)
        fastest = min(_timed(lambda: product(x)) for _ in range(30))
        assert 16 * 1024 * 4096 / fastest < 1.25 * peaks[backend], backend


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def test_the_verify_floor_takes_each_matrix_at_its_backends_peak():
    """A pass over n tokens costs at least n tokens' multiply-adds at the peak, in one-token
    passes, and never less than one pass."""
    from types import SimpleNamespace

    def matrix(backend, n_in, n_out):
        return SimpleNamespace(backend=backend, in_features=n_in, out_features=n_out)

    layer = [matrix("quant", 100, 300), matrix("avx2", 100, 100)]
    model = SimpleNamespace(matrices=layer + layer + [matrix("quant", 100, 400)])  # two layers, the LM head
    peaks = {"quant": 1e6, "avx2": 0.5e6}  # the bf16 matrices take twice as long a multiply-add
    seconds = speed.multiply_add_seconds_per_token(model, peaks)
    assert seconds == pytest.approx((2 * 30_000 + 40_000) / 1e6 + 2 * 10_000 / 0.5e6)  # 0.14 s
    assert speed.verify_floor(seconds, 0.28, (1, 2, 4, 8)) == {"1": 1.0, "2": 1.0, "4": 2.0, "8": 4.0}
    assert speed.multiply_add_seconds_per_token(model, {"quant": 1e6}) is None  # a backend with no peak


def test_the_bandwidth_limit_is_the_fastest_read_and_says_which(monkeypatch):
    rates = {"small": [("torch sum", 20e9), ("4 streams a thread", 31e9)],
             "huge": [("torch sum", 24e9), ("4 streams a thread", 30e9)]}
    pages = iter(["small", "huge"])
    monkeypatch.setattr(speed, "_reads", lambda matrix, repeats: rates[next(pages)])
    assert speed.measure_bandwidth(megabytes=8) == (31e9, "4 streams a thread, small pages")


def test_every_read_is_timed_when_the_kernels_run(kernel_module):
    import torch

    names = [name for name, rate in speed._reads(torch.ones(256, 4096), repeats=1) if rate > 0]
    assert names == ["torch sum", "torch matrix-vector product", "1 stream a thread", "2 streams a thread",
                     "4 streams a thread", "8 streams a thread"]


@pytest.mark.real
def test_speed_on_smollm2_runs_both_sides_and_reports(smollm2_folder):
    r = run_speed(str(smollm2_folder), new_tokens=6, repeats=1, log=lambda _: None, bandwidth_megabytes=128)
    for side in ("native", "transformers"):  # measured, not derived: both sides ran and were timed
        assert r[f"{side}_tokens_per_s"] > 0 and r[f"{side}_prefill_s"] > 0
    assert r["prompt_tokens"] > 1 and r["weight_bytes_per_token"] > 0 and r["bandwidth_gb_per_s"] > 0
    assert "of the limit" in format_speed(r) and r["bandwidth_read"] in format_speed(r)
    from specdecode.models.kernels import kernel_kind

    if kernel_kind() in ("avx512", "avx2"):  # every matrix on the kernel: the curve has its floor
        floor = r["verify_floor"]
        assert floor["1"] == 1.0 and list(floor.values()) == sorted(floor.values())
        assert r["multiply_add_peaks_g_per_s"].keys() == {kernel_kind()} and "its floor" in format_speed(r)
    else:
        assert r["verify_floor"] is None and "its floor" not in format_speed(r)


@pytest.mark.real
def test_speed_interleaves_the_peer_and_reads_the_limit_beside_each_native_run(smollm2_folder, monkeypatch):
    """Each repeat runs ours, reads the bandwidth, then runs llama.cpp; each run's share of
    the limit is taken against the read beside it (a noisy neighbour moves both alike)."""
    events, rates, reads = [], iter([10.0, 40.0, 30.0]), iter([1e9, 4e9, 2e9])

    def native(model, prompt_ids, new_tokens):
        events.append("native")
        return Timing(0.1, (new_tokens - 1) / next(rates), new_tokens) if new_tokens == 9 else Timing(0.1, 1.0, 4)

    def peer():
        events.append("llama.cpp")
        return Timing(0.2, 0.5, 9)

    def read():
        events.append("read")
        return next(reads)

    monkeypatch.setattr(speed, "_time_native", native)
    monkeypatch.setattr(speed, "measure_bandwidth", lambda megabytes: (5e9, "4 streams a thread, small pages"))
    monkeypatch.setattr(speed, "read_again", lambda megabytes, which: read)
    monkeypatch.setattr(speed, "_llamacpp_runner", lambda *args: peer)
    monkeypatch.setattr(speed, "measure_verify_curve", lambda model, sizes: {n: 0.01 * n for n in sizes})
    r = run_speed(str(smollm2_folder), "gguf", new_tokens=9, repeats=3, log=lambda _: None)
    assert events == ["native"] + ["native", "read", "llama.cpp"] * 3  # after the warm-up
    assert r["bandwidth_gb_per_s"] == 2.0 and r["native_tokens_per_s"] == 30.0
    bytes_per_step = r["weight_bytes_per_token"]
    # the shares 10/1, 40/4 and 30/2 (x bytes / 1e9): their median, not 30 tok/s over 2 GB/s
    assert r["fraction_of_limit"] == pytest.approx(10.0 * bytes_per_step / 1e9, abs=1e-3)
    assert r["llamacpp_tokens_per_s"] == 16.0


@pytest.mark.real
def test_speed_times_a_long_prompt_in_chunks(smollm2_folder):
    r = run_speed(str(smollm2_folder), new_tokens=4, repeats=1, log=lambda _: None, bandwidth_megabytes=128,
                  prompt_tokens=600)  # more than one prefill chunk
    assert r["prompt_tokens"] == 600
    for side in ("native", "transformers"):
        assert r[f"{side}_prefill_tokens_per_s"] == pytest.approx(600 / r[f"{side}_prefill_s"], rel=0.01)
    assert "600 prompt tokens" in format_speed(r)


def test_speed_refuses_a_length_with_no_decoding_step():
    with pytest.raises(SpecDecodeError, match="new-tokens >= 2"):  # before anything loads
        run_speed("no-model-is-loaded", new_tokens=1, log=lambda _: None)
