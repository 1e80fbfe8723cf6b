"""`specdecode speed`: plain decoding, native backend vs its peers, side by side.

Each side runs greedy decoding of the same prompt to the same forced length, in the same
process, interleaved (native, llama.cpp, transformers, then again) after a warm-up; the
median of the repeats is reported. transformers runs the same float weights; on a GGUF
target, llama.cpp (the optional binding, llamacpp_peer.py) runs the same file instead.

Tokens/s is the decoding rate: the tokens after the first over the time after the first,
so the prompt's prefill (one pass over every prompt token, which yields the first token)
is timed apart, as `prefill_s`, and as a rate of prompt tokens per second. The end-to-end
rate, prefill included, is reported too. `--prompt-tokens N` times a prompt of N tokens of
standard-library source instead of the short built-in one: the prefill of a long prompt,
and decoding over its long cache.
Beside them stands the physical limit of a decoding step: the weight bytes one step must
stream, divided by the memory read bandwidth. The fastest way to read a 2 GB buffer is
found first, among the reads, on ordinary and on huge pages, that torch makes (a sum, an
fp32 matrix-vector product) and that the kernels make with each thread reading 1, 2, 4 or 8
runs far apart side by side (bandwidth.cpp): one run a thread falls short of the memory
system on some CPUs, and the quantized products read several there. `--json` names it.
That read is then timed again right after each native run, and the share of the limit
reached is the median of the repeats' shares: on a machine shared with other tenants the
bandwidth moves by a third within minutes, so a rate and a limit read minutes apart would
not measure the kernels.
Beneath the verify curve v(n) (a pass over n tokens in one-token passes) stands its floor:
a pass over n tokens performs n tokens' multiply-adds, which take at least that many at
the peak rate of the instruction the products are made of (peak.cpp, timed on every
thread). Where the floor of v(8) is well above 1, verification on this CPU is bound by
arithmetic, and no kernel can make long drafts cheap; where it stays at 1, memory sets the
cost. None is reported where the products are not the kernels' own, or run on AMX tiles,
whose rate is far beyond what memory feeds them.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.commands import llamacpp_peer
from specdecode.core.engine import decode
from specdecode.errors import SpecDecodeError
from specdecode.core.events import Done
from specdecode.models.huge_pages import on_huge_pages
from specdecode.models.kernels import kernel
from specdecode.heads.training.corpus import stdlib_documents
from specdecode.models.load import load, parse_dtype, quant_format
from specdecode.policy.costs import measure_verify_curve
from specdecode.core.prompts import encode_prompt
from specdecode.core.stopping import StopCondition

CURVE_SIZES = (1, 2, 4, 8, 16)  # tokens per pass in the reported verify curve
SPEED_PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


STREAMS = (1, 2, 4, 8)  # runs a thread reads side by side, in the kernels' read
PEAK_ITERATIONS = 1 << 24  # steps of each chain in one timed run of peak.cpp (its most): about 0.1 s


def measure_bandwidth(megabytes: int = 2048, repeats: int = 3) -> tuple[float, str]:
    """(bytes per second, which read) of the fastest read of a buffer of `megabytes`.

    The buffer must dwarf the last-level cache (480 MB on the largest here), or the figure
    measures the cache: a 50 MB matrix "streams" at 49 GB/s there, a 2 GB buffer at 30.
    """
    best = (0.0, "none")
    for pages in PAGES:  # the weights stream from huge pages (models/huge_pages.py): so may this
        matrix = _buffer(megabytes, pages)
        best = max(best, *((rate, f"{name}, {pages} pages") for name, rate in _reads(matrix, repeats)))
        del matrix  # freed before the next buffer is made: a peak of 2 GB, not 4
    return best


PAGES = ("small", "huge")


def _buffer(megabytes: int, pages: str) -> torch.Tensor:
    matrix = torch.ones(megabytes * 2**20 // 4 // 4096, 4096, dtype=torch.float32)
    return on_huge_pages(matrix) if pages == "huge" else matrix


def _read_functions(matrix: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each way of reading matrix whole, by name."""
    vector = torch.ones(1, matrix.shape[1], dtype=torch.float32)
    reads = {"torch sum": lambda: matrix.sum(),
             "torch matrix-vector product": lambda: torch.nn.functional.linear(vector, matrix)}
    module = kernel()
    if module is not None:
        for n in STREAMS:
            reads[f"{n} stream{'s' if n > 1 else ''} a thread"] = lambda n=n: module.read_streams(matrix, n)
    return reads


def _fastest_rate(matrix: torch.Tensor, read: Callable[[], object], repeats: int) -> float:
    """Bytes per second of the fastest of `repeats` reads of matrix (after one untimed)."""
    read()
    fastest = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        read()
        fastest = min(fastest, time.perf_counter() - t)
    return matrix.numel() * 4 / fastest


def _reads(matrix: torch.Tensor, repeats: int) -> list[tuple[str, float]]:
    """(read, bytes per second of its fastest repeat) for each way of reading matrix."""
    return [(name, _fastest_rate(matrix, read, repeats)) for name, read in _read_functions(matrix).items()]


def measure_multiply_add_peaks(repeats: int = 5) -> dict[str, float]:
    """Multiply-adds a second that each product backend's instruction reaches at most on
    this machine's threads, the fastest of `repeats` runs: "quant" (quantized blocks) and
    the bf16 kernel's kind. Empty without the kernels, or with AMX (see above)."""
    module = kernel()
    if module is None or module.kind == "amx":
        return {}
    return {backend: max(module.multiply_add_peak(backend == "quant", PEAK_ITERATIONS)[0] for _ in range(repeats))
            for backend in ("quant", module.kind)}


def multiply_add_seconds_per_token(model, peaks: dict[str, float]) -> float | None:
    """The least time one token's multiply-adds take: each matrix's at its backend's peak.
    None where a matrix runs on a backend with no measured peak (fp32 on oneDNN, say)."""
    if any(m.backend not in peaks for m in model.matrices):
        return None
    return sum(m.in_features * m.out_features / peaks[m.backend] for m in model.matrices)


def verify_floor(seconds_per_token: float, one_token_s: float, sizes) -> dict[str, float]:
    """The least a pass over n tokens can cost in one-token passes: its multiply-adds at
    the peak, or one pass, whichever takes longer."""
    return {str(n): round(max(1.0, n * seconds_per_token / one_token_s), 3) for n in sizes}


def read_again(megabytes: int, which: str, repeats: int = 3) -> Callable[[], float]:
    """A timer of the read `which` (as measure_bandwidth names it) on a buffer kept for it:
    each call returns the bytes per second of its fastest of `repeats`. `speed` reads after
    each decoding run, so that a rate and its limit are measured together: on a machine
    shared with other tenants the bandwidth moves by a third within minutes."""
    name, pages = which.rsplit(", ", 1)
    matrix = _buffer(megabytes, pages.removesuffix(" pages"))
    read = _read_functions(matrix)[name]
    return lambda: _fastest_rate(matrix, read, repeats)


@dataclass(frozen=True)
class Timing:
    """One generation: seconds from the call to the first new token, and after it."""

    prefill_s: float
    decode_s: float
    new_tokens: int

    @property
    def tokens_per_s(self) -> float:
        """The decoding rate: the tokens after the first over the time after the first."""
        return (self.new_tokens - 1) / self.decode_s

    @property
    def end_to_end_tokens_per_s(self) -> float:
        return self.new_tokens / (self.prefill_s + self.decode_s)


def _time_native(model, prompt_ids: list[int], new_tokens: int) -> Timing:
    stop = StopCondition(max_new_tokens=new_tokens)  # no EOS: force the length
    count, first_at = 0, None
    t = time.perf_counter()
    for event in decode(model, prompt_ids, stop):
        if isinstance(event, Done):
            break
        count += len(event.token_ids)
        if first_at is None:  # the prefill's round: the first token
            first_at = time.perf_counter()
    end = time.perf_counter()
    assert count == new_tokens, (count, new_tokens)
    return Timing(first_at - t, end - first_at, new_tokens)


class FirstTokenClock:
    """A `generate` streamer that notes when the first new token comes: its first `put`
    is the prompt, its second the first new token."""

    def __init__(self):
        self.puts, self.first_at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def _time_transformers(hf_model, prompt_ids: list[int], new_tokens: int) -> Timing:
    ids = torch.tensor([prompt_ids])
    clock = FirstTokenClock()
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
    end = time.perf_counter()
    assert out.shape[1] - ids.shape[1] == new_tokens and clock.first_at is not None
    return Timing(clock.first_at - t, end - clock.first_at, new_tokens)


def long_prompt(tokenizer, tokens: int) -> list[int]:
    """`tokens` token ids of standard-library source, the same on every run."""
    ids = [t for chunk in stdlib_documents(tokenizer, tokens, tokens) for t in chunk]
    if len(ids) < tokens:
        raise SpecDecodeError(f"the standard library's source gave {len(ids)} tokens, fewer than {tokens}")
    return ids


def _llamacpp_runner(quant: str | None, folder, prompt_ids: list[int], new_tokens: int,
                     log) -> Callable[[], Timing] | None:
    """A timer of llama.cpp on the target's GGUF file (one run a call), or None (with a note)
    where it cannot run."""
    if quant != "gguf":
        return None
    gguf, why = llamacpp_peer.target_gguf(folder, 0.0)
    if why is not None:
        log(f"llama.cpp not timed: {why}")
        return None
    log(f"loading llama.cpp on {gguf.name}")
    run = llamacpp_peer.plain_runner(gguf, torch.get_num_threads(), prompt_ids, new_tokens)
    return lambda: Timing(*run(), new_tokens)


def run_speed(target: str, dtype: str | None = None, new_tokens: int = 64, repeats: int = 3,
              log=print, bandwidth_megabytes: int = 2048, prompt_tokens: int | None = None) -> dict:
    if new_tokens < 2 or repeats < 1:
        raise SpecDecodeError(f"speed needs --new-tokens >= 2 and --repeats >= 1, got {new_tokens} and {repeats}")
    if prompt_tokens is not None and prompt_tokens < 1:
        raise SpecDecodeError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    torch_dtype, quant = parse_dtype(dtype), quant_format(dtype)
    model, tokenizer, info = load(target, dtype, backend="native")
    short_ids = encode_prompt(tokenizer, SPEED_PROMPT)
    prompt_ids = short_ids if prompt_tokens is None else long_prompt(tokenizer, prompt_tokens)
    if len(prompt_ids) + new_tokens > model.max_position_embeddings:
        raise SpecDecodeError(f"{len(prompt_ids)} prompt tokens + {new_tokens} new exceed the model's context of "
                              f"{model.max_position_embeddings}")
    hf_model = None
    if quant is None:  # transformers runs float weights only: no like-for-like peer for quantized ones
        from transformers import AutoModelForCausalLM

        log(f"loading transformers' model from {info.folder}")
        hf_model = AutoModelForCausalLM.from_pretrained(str(info.folder), dtype=torch_dtype).eval()

    log("measuring the memory read bandwidth")
    _, bandwidth_read = measure_bandwidth(bandwidth_megabytes)
    bandwidth_now = read_again(bandwidth_megabytes, bandwidth_read)
    llamacpp_run = _llamacpp_runner(quant, info.folder, prompt_ids, new_tokens, log)
    log("warming up")
    _time_native(model, short_ids, 4)
    if hf_model is not None:
        _time_transformers(hf_model, short_ids, 4)
    native, hf, llamacpp, bandwidths = [], [], [], []
    for r in range(repeats):  # every side once a repeat, so that each sees the machine as the others do
        native.append(_time_native(model, prompt_ids, new_tokens))
        bandwidths.append(bandwidth_now())  # the limit read right after the rate set against it
        if llamacpp_run is not None:
            llamacpp.append(llamacpp_run())
        if hf_model is not None:
            hf.append(_time_transformers(hf_model, prompt_ids, new_tokens))
        log(f"repeat {r + 1}/{repeats}: native {native[-1].tokens_per_s:.2f} tok/s"
            + (f", llama.cpp {llamacpp[-1].tokens_per_s:.2f} tok/s" if llamacpp else "")
            + (f", transformers {hf[-1].tokens_per_s:.2f} tok/s" if hf else "")
            + f", memory read {bandwidths[-1] / 1e9:.1f} GB/s")
    del bandwidth_now, llamacpp_run  # the read buffer and llama.cpp's model: neither held while the passes are timed
    log("timing passes over 1, 2, 4, 8 and 16 tokens")
    curve = measure_verify_curve(model, CURVE_SIZES)
    peaks = measure_multiply_add_peaks()
    arithmetic_s = multiply_add_seconds_per_token(model, peaks)
    peaks_used = {} if arithmetic_s is None else {m.backend: peaks[m.backend] for m in model.matrices}

    def median(timings: list[Timing], rate: str) -> float | None:
        return round(statistics.median(getattr(t, rate) for t in timings), 3) if timings else None

    def prefill_rate(timings: list[Timing]) -> float | None:
        return round(len(prompt_ids) / statistics.median(t.prefill_s for t in timings), 2) if timings else None

    native_tps, hf_tps = median(native, "tokens_per_s"), median(hf, "tokens_per_s")
    bandwidth = statistics.median(bandwidths)
    limit_tps = bandwidth / model.weight_bytes_per_token
    # each repeat's rate against the limit read beside it, then their median
    fraction = statistics.median(t.tokens_per_s * model.weight_bytes_per_token / b for t, b in zip(native, bandwidths))
    return {
        "target": target,
        "dtype": quant or str(torch_dtype).removeprefix("torch."),
        "new_tokens": new_tokens,
        "prompt_tokens": len(prompt_ids),
        "repeats": repeats,
        "native_tokens_per_s": native_tps,
        "transformers_tokens_per_s": hf_tps,
        "ratio": round(native_tps / hf_tps, 3) if hf_tps else None,
        "native_prefill_s": round(statistics.median(t.prefill_s for t in native), 4),
        "transformers_prefill_s": round(statistics.median(t.prefill_s for t in hf), 4) if hf else None,
        "native_prefill_tokens_per_s": prefill_rate(native),
        "transformers_prefill_tokens_per_s": prefill_rate(hf),
        "native_end_to_end_tokens_per_s": median(native, "end_to_end_tokens_per_s"),
        "transformers_end_to_end_tokens_per_s": median(hf, "end_to_end_tokens_per_s"),
        "llamacpp_tokens_per_s": median(llamacpp, "tokens_per_s"),
        "llamacpp_prefill_s": round(statistics.median(t.prefill_s for t in llamacpp), 4) if llamacpp else None,
        "llamacpp_prefill_tokens_per_s": prefill_rate(llamacpp),
        "llamacpp_end_to_end_tokens_per_s": median(llamacpp, "end_to_end_tokens_per_s"),
        "verify_curve": {str(n): round(curve[n] / curve[1], 3) for n in CURVE_SIZES},
        "one_token_pass_ms": round(1e3 * curve[1], 2),
        "verify_floor": None if arithmetic_s is None else verify_floor(arithmetic_s, curve[1], CURVE_SIZES),
        "multiply_adds_per_token": model.multiply_adds_per_token,
        "multiply_add_peaks_g_per_s": {backend: round(rate / 1e9, 1) for backend, rate in peaks_used.items()},
        "weight_bytes_per_token": model.weight_bytes_per_token,
        "resident_weight_bytes": model.memory_bytes,
        "bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
        "bandwidth_read": bandwidth_read,
        "limit_tokens_per_s": round(limit_tps, 3),
        "fraction_of_limit": round(fraction, 3),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }


def format_speed(r: dict) -> str:
    def row(name: str, peer: str) -> str:
        return (f"  {name:<13} {r[f'{peer}_tokens_per_s']:8.2f} tok/s   prefill {r[f'{peer}_prefill_s']:.2f} s "
                f"({r[f'{peer}_prefill_tokens_per_s']:.1f} prompt tok/s), "
                f"end to end {r[f'{peer}_end_to_end_tokens_per_s']:.2f} tok/s")

    lines = [
        f"target {r['target']}, {r['dtype']}, {r['prompt_tokens']} prompt tokens, {r['new_tokens']} new tokens, "
        f"median of {r['repeats']}, {r['threads']} threads",
        f"  decoding, after the first token (the prompt's prefill timed apart):",
        row("native", "native"),
    ]
    if r["transformers_tokens_per_s"] is not None:
        lines += [row("transformers", "transformers"), f"  ratio         {r['ratio']:8.2f}x"]
    else:
        lines.append(f"  transformers  (not run: it has no {r['dtype']} weights)")
    if r["llamacpp_tokens_per_s"] is not None:
        lines.append(row("llama.cpp", "llamacpp"))
    curve = "  ".join(f"v({n}) {v:.2f}" for n, v in r["verify_curve"].items() if n != "1")
    lines += [
        f"  limit         {r['limit_tokens_per_s']:8.2f} tok/s  ({r['weight_bytes_per_token'] / 1e9:.2f} GB per step "
        f"at {r['bandwidth_gb_per_s']:.1f} GB/s measured: {r['bandwidth_read']})",
        f"  native reaches {100 * r['fraction_of_limit']:.0f}% of the limit (median of the repeats, each against "
        f"the bandwidth read right after it)",
        f"  a pass over n tokens against one ({r['one_token_pass_ms']:.1f} ms, after 256 cached): {curve}",
    ]
    if r["verify_floor"] is not None:
        floor = "  ".join(f"v({n}) >= {v:.2f}" for n, v in r["verify_floor"].items() if n != "1")
        peaks = ", ".join(f"{rate:.0f} G/s ({'quantized blocks' if backend == 'quant' else 'bf16 weights'})"
                          for backend, rate in r["multiply_add_peaks_g_per_s"].items())
        lines.append(f"  its floor, {r['multiply_adds_per_token'] / 1e9:.2f} G multiply-adds a token at this CPU's "
                     f"peak of {peaks}: {floor}")
    lines.append(f"  weights held  {r['resident_weight_bytes'] / 1e9:.2f} GB")
    return "\n".join(lines)
