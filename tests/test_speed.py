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
