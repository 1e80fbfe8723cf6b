"""`specdecode bench`: every method against plain decoding and the peers, per prompt kind.

For each prompt, every method runs greedy to the same budget, interleaved (plain, method
A, method B, ..., peers; then again) after a warm-up, and the median of the repeats is
kept (../shared/benchmark.md). Methods are our plain decoding, the draft model at each k,
prompt lookup, and transformers' plain `generate`, `assistant_model=` and
`prompt_lookup_num_tokens=` on the same weights and dtype. Per kind it reports speedup
over our plain decoding (time per token), α, τ, the time split, the theoretical speedup
from the measured α, draft cost and verify cost, and whether our greedy output was
identical to plain decoding.

Theory (design.md): with acceptance α i.i.d. per position and k drafts, a round emits
E = (1 - α^(k+1)) / (1 - α) tokens and costs k draft steps plus one verify pass, so
speedup = E · t_plain_step / (k · t_draft_step + t_verify(k+1)). Real acceptance comes in
runs (a drafter right once is likely right again), so E(α) underestimates the measured τ
at larger k; the report also gives the bound with the measured τ in place of E, whose
ratio to the measured speedup is the share of time lost outside drafting and verifying.

Left out (a later issue): task suites from files, plots, tuning of k per category.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .api import DEFAULT_DRAFT, DEFAULT_TARGET, load_model, make_draft_model
from .drafters import PromptLookup
from .engine import decode
from .events import collect
from .prompts import encode_prompt
from .stopping import StopCondition

BENCH_PROMPTS = {
    "code": "Write a Python function `merge_sorted(a, b)` that merges two sorted lists into one sorted list.",
    "code edit": "Rename the variable `tmp` to `total` in this function and return the code:\n\n"
                 "def sum_squares(values):\n    tmp = 0\n    for v in values:\n        tmp += v * v\n"
                 "    return tmp\n\n\ndef mean(values):\n    tmp = sum(values)\n    return tmp / len(values)\n",
    "prose": "Write a short paragraph about why people enjoy walking in the mountains.",
}


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E = (1 - α^(k+1)) / (1 - α): tokens a round emits with i.i.d. acceptance α."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def theoretical_speedup(alpha: float, k: int, plain_step_s: float, draft_step_s: float, verify_s: float) -> float:
    return expected_tokens_per_round(alpha, k) * plain_step_s / (k * draft_step_s + verify_s)


@dataclass
class Run:
    seconds: float
    tokens: list[int]
    stats: object = None


def run_ours(target, prompt_ids, stop, drafter=None, k=0) -> Run:
    started = time.perf_counter()
    tokens, done = collect(decode(target.model, prompt_ids, stop, drafter=drafter, k=k))
    return Run(time.perf_counter() - started, tokens, done.stats)


def run_transformers(hf_target, prompt_ids, max_new_tokens, eos, **kw) -> Run:
    ids = torch.tensor([prompt_ids])
    started = time.perf_counter()
    with torch.inference_mode():
        out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0], **kw)
    return Run(time.perf_counter() - started, out[0, len(prompt_ids):].tolist())


def run_bench(target_name=DEFAULT_TARGET, draft_name=DEFAULT_DRAFT, ks=(2, 3, 4), lookup_k=4,
              max_new_tokens=64, repeats=3, peers=True, out_dir: Path | None = None, log=print) -> dict:
    from transformers import AutoModelForCausalLM

    target, draft = load_model(target_name), load_model(draft_name)
    eos = target.info.eos_token_ids
    stop = StopCondition(frozenset(eos), max_new_tokens=max_new_tokens)
    methods = {"plain": lambda ids: run_ours(target, ids, stop)}
    for k in ks:
        methods[f"draft-model k={k}"] = lambda ids, k=k: run_ours(target, ids, stop, make_draft_model(target, draft), k)
    methods[f"prompt-lookup k={lookup_k}"] = lambda ids: run_ours(target, ids, stop, PromptLookup(), lookup_k)
    if peers:
        log("loading transformers' copies of the same weights for the peers")
        hf_target = AutoModelForCausalLM.from_pretrained(str(target.info.folder), dtype=target.model.dtype).eval()
        hf_draft = AutoModelForCausalLM.from_pretrained(str(draft.info.folder), dtype=target.model.dtype).eval()
        methods["transformers plain"] = lambda ids: run_transformers(hf_target, ids, max_new_tokens, eos)
        methods["transformers assisted"] = lambda ids: run_transformers(hf_target, ids, max_new_tokens, eos,
                                                                         assistant_model=hf_draft)
        methods[f"transformers prompt-lookup k={lookup_k}"] = lambda ids: run_transformers(
            hf_target, ids, max_new_tokens, eos, prompt_lookup_num_tokens=lookup_k)

    rows = []
    log("warm-up: every method once")
    for run in methods.values():
        run(encode_prompt(target.tokenizer, next(iter(BENCH_PROMPTS.values()))))
    for kind, prompt in BENCH_PROMPTS.items():
        prompt_ids = encode_prompt(target.tokenizer, prompt)
        runs: dict[str, list[Run]] = {name: [] for name in methods}
        for r in range(repeats):
            for name, run in methods.items():
                runs[name].append(run(prompt_ids))
            log(f"[{kind}] repeat {r + 1}/{repeats}: " + ", ".join(
                f"{n} {len(v[-1].tokens) / v[-1].seconds:.2f}" for n, v in runs.items()) + " tok/s")
        rows += summarize(kind, runs, ks, lookup_k)
    result = {"target": target_name, "draft": draft_name, "dtype": str(target.model.dtype).removeprefix("torch."),
              "max_new_tokens": max_new_tokens, "repeats": repeats, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "target_sha256": target.info.sha256, "draft_sha256": draft.info.sha256, "rows": rows}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(result, indent=1))
        (out_dir / "report.md").write_text(format_table(result) + "\n")
    return result


def summarize(kind: str, runs: dict[str, list[Run]], ks, lookup_k) -> list[dict]:
    def per_token(name):  # median seconds per emitted token
        return statistics.median(r.seconds / max(1, len(r.tokens)) for r in runs[name])

    plain = runs["plain"][0]
    plain_step = statistics.median(r.stats.verify_s / max(1, r.stats.rounds) for r in runs["plain"])
    rows = []
    for name in runs:
        row = {"kind": kind, "method": name, "tokens_per_s": 1 / per_token(name),
               "speedup": per_token("plain") / per_token(name)}
        stats = runs[name][0].stats
        if stats is not None:
            row["identical_to_plain"] = all(r.tokens == plain.tokens for r in runs[name])
            row.update(acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
                       acceptance_by_position=stats.acceptance_by_position)
            if stats.draft_tokens:
                k = int(name.split("k=")[1])
                verify = statistics.median(r.stats.verify_s / r.stats.rounds for r in runs[name])
                draft_step = statistics.median(r.stats.draft_s / max(1, r.stats.draft_tokens) for r in runs[name])
                row["theoretical_speedup"] = theoretical_speedup(stats.acceptance_rate, k, plain_step, draft_step, verify)
                # The same cost model fed the measured τ instead of the i.i.d. E(α): what this
                # run would give with no time outside drafting and verification.
                row["bound_speedup"] = stats.mean_accepted_length * plain_step / (
                    draft_step * stats.draft_tokens / stats.rounds + verify)
                row["time_split"] = {"draft_s": stats.draft_s, "verify_s": stats.verify_s, "other_s": stats.other_s}
        else:
            row["identical_to_plain"] = None  # transformers' numerics differ from ours in bf16
        rows.append(row)
    return rows


def format_table(result: dict) -> str:
    lines = [f"target {result['target']}, draft {result['draft']}, {result['dtype']}, greedy, "
             f"{result['max_new_tokens']} new tokens, median of {result['repeats']}, {result['threads']} threads", "",
             "| kind | method | tok/s | speedup | theory E(α) | bound τ | α | τ | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        theory = f"{r['theoretical_speedup']:.2f}x" if "theoretical_speedup" in r else ""
        bound = f"{r['bound_speedup']:.2f}x" if "bound_speedup" in r else ""
        alpha = f"{r['acceptance_rate']:.2f}" if r.get("acceptance_rate") else ""
        tau = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else ""
        same = {True: "yes", False: "NO", None: "n/a"}[r["identical_to_plain"]]
        lines.append(f"| {r['kind']} | {r['method']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {theory} | {bound} "
                     f"| {alpha} | {tau} | {same} |")
    return "\n".join(lines)
