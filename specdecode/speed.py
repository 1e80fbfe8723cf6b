"""`specdecode speed`: plain decoding, native backend vs transformers, side by side.

Both run greedy decoding of the same prompt to the same forced length, in the same
dtype and process, interleaved (native, transformers, native, ...) after a warm-up; the
median of the repeats is reported (../shared/benchmark.md). Beside them stands the
physical limit: the weight bytes one decoding step must stream, divided by the memory
read bandwidth measured in this run: the best of two streaming reads (a sum and an fp32
matrix-vector product) of a buffer four times the size of the last-level cache, on
ordinary and on huge pages.
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from .engine import decode
from .events import collect
from .models.huge_pages import on_huge_pages
from .models.load import load, parse_dtype
from .prompts import encode_prompt
from .stopping import StopCondition

SPEED_PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


def measure_bandwidth(megabytes: int = 2048, repeats: int = 3) -> float:
    """Bytes per second of the fastest streaming read of an fp32 buffer of `megabytes`.

    The buffer must dwarf the last-level cache (480 MB on this machine), or the figure
    measures the cache: a 50 MB matrix "streams" at 49 GB/s here, a 2 GB buffer at 30.
    """
    cols = 4096
    vector = torch.ones(1, cols, dtype=torch.float32)
    best = 0.0
    for pages in ("small", "huge"):  # the weights stream from huge pages (models/huge_pages.py): so may this
        matrix = torch.ones(megabytes * 2**20 // 4 // cols, cols, dtype=torch.float32)
        if pages == "huge":
            matrix = on_huge_pages(matrix)
        best = max(best, _fastest_read(matrix, vector, repeats))
        del matrix  # freed before the next buffer is made: a peak of 2 GB, not 4
    return best


def _fastest_read(matrix: torch.Tensor, vector: torch.Tensor, repeats: int) -> float:
    """Bytes per second of the fastest of a sum and a matrix-vector product over matrix."""
    best = 0.0
    for read in (lambda: matrix.sum(), lambda: torch.nn.functional.linear(vector, matrix)):
        read()
        for _ in range(repeats):
            t = time.perf_counter()
            read()
            best = max(best, matrix.numel() * 4 / (time.perf_counter() - t))
    return best


def _time_native(model, prompt_ids: list[int], new_tokens: int) -> float:
    stop = StopCondition(max_new_tokens=new_tokens)  # no EOS: force the length
    t = time.perf_counter()
    tokens, _ = collect(decode(model, prompt_ids, stop))
    elapsed = time.perf_counter() - t
    assert len(tokens) == new_tokens, (len(tokens), new_tokens)
    return elapsed


def _time_transformers(hf_model, prompt_ids: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - t
    assert out.shape[1] - ids.shape[1] == new_tokens
    return elapsed


def run_speed(target: str, dtype: str | None = None, new_tokens: int = 64, repeats: int = 3,
              log=print) -> dict:
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype)
    model, tokenizer, info = load(target, torch_dtype, backend="native")
    log(f"loading transformers' model from {info.folder}")
    hf_model = AutoModelForCausalLM.from_pretrained(str(info.folder), dtype=torch_dtype).eval()
    prompt_ids = encode_prompt(tokenizer, SPEED_PROMPT)

    log("warming up")
    _time_native(model, prompt_ids, 4)
    _time_transformers(hf_model, prompt_ids, 4)
    native_s, hf_s = [], []
    for r in range(repeats):
        native_s.append(_time_native(model, prompt_ids, new_tokens))
        hf_s.append(_time_transformers(hf_model, prompt_ids, new_tokens))
        log(f"repeat {r + 1}/{repeats}: native {new_tokens / native_s[-1]:.2f} tok/s, "
            f"transformers {new_tokens / hf_s[-1]:.2f} tok/s")
    bandwidth = measure_bandwidth()
    native_tps = new_tokens / statistics.median(native_s)
    hf_tps = new_tokens / statistics.median(hf_s)
    limit_tps = bandwidth / model.weight_bytes_per_token
    return {
        "target": target,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "new_tokens": new_tokens,
        "prompt_tokens": len(prompt_ids),
        "repeats": repeats,
        "native_tokens_per_s": round(native_tps, 3),
        "transformers_tokens_per_s": round(hf_tps, 3),
        "ratio": round(native_tps / hf_tps, 3),
        "weight_bytes_per_token": model.weight_bytes_per_token,
        "bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
        "limit_tokens_per_s": round(limit_tps, 3),
        "fraction_of_limit": round(native_tps / limit_tps, 3),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }


def format_speed(r: dict) -> str:
    return "\n".join([
        f"target {r['target']}, {r['dtype']}, {r['new_tokens']} new tokens, median of {r['repeats']}, "
        f"{r['threads']} threads",
        f"  native        {r['native_tokens_per_s']:8.2f} tok/s",
        f"  transformers  {r['transformers_tokens_per_s']:8.2f} tok/s",
        f"  ratio         {r['ratio']:8.2f}x",
        f"  limit         {r['limit_tokens_per_s']:8.2f} tok/s  ({r['weight_bytes_per_token'] / 1e9:.2f} GB per step "
        f"at {r['bandwidth_gb_per_s']:.1f} GB/s measured)",
        f"  native reaches {100 * r['fraction_of_limit']:.0f}% of the limit",
    ])
