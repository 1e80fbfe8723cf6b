"""llama.cpp as a peer in `bench` and `speed`: its plain decoding and its prompt-lookup
speculation on the same GGUF file, prompt token ids, greedy budget and thread count as ours.

It runs through the llama-cpp-python binding, an optional extra
(`pip install -e '.[llamacpp]'`, which builds llama.cpp from source: 10-15 minutes on two
cores). Where the binding is missing, or the target has no GGUF file, or sampling is
asked for, the peer is skipped with a one-line note. Its output is not compared with ours
for identity: llama.cpp's kernels round differently.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.store import gguf_file


def unavailable(temperature: float) -> str | None:
    """Why the llama.cpp peer cannot run here, or None."""
    if temperature > 0:
        return "it runs greedy decoding only"
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as err:  # not installed, or its library failed to load
        return f"the llama-cpp-python binding is not available ({err}); pip install -e '.[llamacpp]'"
    return None


def target_gguf(folder: Path, temperature: float) -> tuple[Path | None, str | None]:
    """(the target's GGUF file, None) where the peer can run on it, else (None, why not)."""
    why = unavailable(temperature)
    if why is not None:
        return None, why
    try:
        return gguf_file(folder, progress=False), None
    except SpecDecodeError as err:
        return None, f"no GGUF file for the target ({err})"


def _load(gguf: Path, threads: int, context: int, **kwargs):
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False,
                 **kwargs)


def greedy(llm, prompt_ids: Sequence[int], max_new_tokens: int,
           eos: Sequence[int] = ()) -> tuple[float, list[int], float]:
    """(seconds, new token ids, seconds to the first new token) of llama.cpp's greedy
    decoding of up to max_new_tokens, stopping at an `eos` token (not kept)."""
    llm.reset()  # else a repeated prompt would skip its prefill, reusing the cached prefix
    tokens: list[int] = []
    started, first_at = time.perf_counter(), None
    for token in llm.generate(list(prompt_ids), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        first_at = first_at or time.perf_counter()
        if token in eos:
            break
        tokens.append(token)
        if len(tokens) >= max_new_tokens:
            break
    return time.perf_counter() - started, tokens, first_at - started


def plain_timings(gguf: Path, threads: int, prompt_ids: Sequence[int], new_tokens: int,
                  repeats: int) -> list[tuple[float, float]]:
    """(seconds to the first new token, seconds after it) of llama.cpp's plain greedy decoding
    of exactly new_tokens tokens (end-of-text ignored), once per repeat after a warm-up, as
    `speed` times ours: the first span is the prompt's prefill."""
    llm = _load(gguf, threads, len(prompt_ids) + new_tokens + 16)
    greedy(llm, prompt_ids[:16], 4)  # a warm-up: a short prefill and a few steps
    timings = []
    for _ in range(repeats):
        seconds, _, first = greedy(llm, prompt_ids, new_tokens)
        timings.append((first, seconds - first))
    return timings


def peer_runs(gguf: Path, threads: int, max_new_tokens: int, eos: Sequence[int], lookup_k: int,
              context: int = 4096) -> list[tuple[str, int | None, Callable]]:
    """(name, k, run) for llama.cpp's plain decoding and its prompt lookup (k = lookup_k);
    each run takes (prompt ids, category) and returns what `greedy` does."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def runner(llm):
        return lambda prompt_ids, category: greedy(llm, prompt_ids, max_new_tokens, eos)

    # With a draft model the binding keeps logits for every token (logits_all), but sizes
    # that buffer by n_batch rows: a prompt longer than a batch overflows it unless the
    # batch spans the context. Those logits cost its prompt lookup prefill time (the
    # vocabulary product on every prompt row) that its plain decoding does not pay.
    lookup = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k)
    return [("llama.cpp plain", None, runner(_load(gguf, threads, context))),
            ("llama.cpp prompt-lookup", lookup_k, runner(_load(gguf, threads, context, draft_model=lookup,
                                                                n_batch=context)))]
