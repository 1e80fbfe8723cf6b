"""llama.cpp as a peer in `bench` and `speed`: its plain decoding and its prompt-lookup
speculation on the same GGUF file, prompt token ids, greedy budget and thread count as ours.

It runs through the llama-cpp-python binding, an optional extra
(`pip install -e '.[llamacpp]'`, which builds llama.cpp from source: 10-15 minutes on two
cores). Where the binding is missing, or the target has no GGUF file, or sampling is
asked for, the peer is skipped with a one-line note. So is a build that crashes: the
binding runs in this process, so before it is loaded here a test process runs a pass over
several tokens with it (GCC 12, Debian 12's compiler, miscompiles llama.cpp's AMX code,
which then faults on Intel CPUs with AMX; built with clang it runs). Its output is not
compared with ours for identity: llama.cpp's kernels round differently.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.kernels import cpu_has_amx
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
        gguf = gguf_file(folder, progress=False)
    except SpecDecodeError as err:
        return None, f"no GGUF file for the target ({err})"
    crash = crashes((sys.executable, "-c", _PROBE, str(gguf)))
    return (None, crash) if crash else (gguf, None)


# A pass over 16 tokens (llama.cpp's batched products, AMX's among them) and one step.
_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=64, verbose=False)
llm.eval(list(range(100, 116)))
llm.eval([116])
"""
_CLANG = "CC=clang CXX=clang++ pip install --force-reinstall --no-deps --no-binary llama-cpp-python -e '.[llamacpp]'"


@functools.cache
def crashes(command: tuple[str, ...]) -> str | None:
    """Why the llama.cpp build fails a test run of `command` in a process of its own (a
    signal or an error), or None where it runs."""
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        how = f"crashed ({signal.Signals(-done.returncode).name})"
    else:
        how = f"failed ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode})"
    hint = f"; GCC 12 miscompiles its AMX code, rebuild it with clang: {_CLANG}" if cpu_has_amx() else ""
    return f"llama.cpp {how} on a test pass over 16 tokens{hint}"


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


def plain_runner(gguf: Path, threads: int, prompt_ids: Sequence[int],
                 new_tokens: int) -> Callable[[], tuple[float, float]]:
    """A timer of llama.cpp's plain greedy decoding of exactly new_tokens tokens (end-of-text
    ignored), loaded and warmed up: each call returns (seconds to the first new token, seconds
    after it), as `speed` times ours, the first span being the prompt's prefill. `speed`
    calls it between its own runs, so both see the machine alike."""
    llm = _load(gguf, threads, len(prompt_ids) + new_tokens + 16)
    greedy(llm, prompt_ids[:16], 4)  # a warm-up: a short prefill and a few steps

    def run() -> tuple[float, float]:
        seconds, _, first = greedy(llm, prompt_ids, new_tokens)
        return first, seconds - first

    return run


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
