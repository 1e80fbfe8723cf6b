"""`specdecode demo`: the default pair on a few kinds of prompt, speculative vs plain.

For each prompt it streams the speculative answer, then decodes the same prompt plainly
and prints tok/s of both, the speedup, α, τ and whether the greedy outputs are identical
(they must be). Timings are of one run each on a shared machine: indicative only; the
`bench` command measures properly (interleaved repeats).
"""

from __future__ import annotations

import sys

from specdecode.api import load_model
from specdecode.options import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.plan import make_draft_model, policy_for, tuned_drafter
from specdecode.core.engine import decode
from specdecode.errors import SpecDecodeError
from specdecode.core.events import collect
from specdecode.core.prompts import encode_prompt
from specdecode.core.stopping import StopCondition
from specdecode.commands.textstream import TextStream
from specdecode.policy.adaptive import AdaptiveK
from specdecode.policy.profile import Profile

# Each demo prompt's kind, and the task category of a `tune` profile that matches it.
CATEGORY = {"code": "code-completion", "code edit": "code-edit", "prose": "chat"}

DEMO_PROMPTS = [
    ("code", "Write a Python function `quicksort(items)` that returns a sorted copy of a list."),
    ("code edit", "Add type hints and a docstring to this function, changing nothing else:\n\n"
                  "def moving_average(values, window):\n"
                  "    if window <= 0:\n"
                  "        raise ValueError('window must be positive')\n"
                  "    out = []\n"
                  "    total = 0\n"
                  "    for i, v in enumerate(values):\n"
                  "        total += v\n"
                  "        if i >= window:\n"
                  "            total -= values[i - window]\n"
                  "        if i >= window - 1:\n"
                  "            out.append(total / window)\n"
                  "    return out\n"),
    ("prose", "In a short paragraph, explain to a new programmer why code review matters."),
]


def _run(target, prompt_ids, stop, drafter=None, k=4, on_round=None):
    tokens, done = collect(decode(target.model, prompt_ids, stop, drafter=drafter, k=k), on_round)
    return tokens, done.stats


def run_demo(max_new_tokens: int = 96, k: int | None = None, dtype: str | None = None, profile: str | None = None,
             out=sys.stdout) -> list[dict]:
    if profile is not None and k is not None:
        raise SpecDecodeError("pass --k or --profile, not both: the profile chooses k")
    if k is not None and k < 1:
        raise SpecDecodeError(f"the draft length k must be >= 1, got {k}")
    print(f"loading {DEFAULT_TARGET} (target) and {DEFAULT_DRAFT} (draft); the first run downloads them",
          file=out, flush=True)
    target, draft = load_model(DEFAULT_TARGET, dtype), load_model(DEFAULT_DRAFT, dtype, as_draft=True)
    tuned = Profile.load(profile) if profile is not None else None
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=max_new_tokens)
    rows = []
    for kind, prompt in DEMO_PROMPTS:
        prompt_ids = encode_prompt(target.tokenizer, prompt)
        print(f"\n=== {kind}: {prompt.splitlines()[0]}", file=out, flush=True)
        text = TextStream(target.tokenizer)

        def show(event):
            out.write(text.add(event.token_ids))
            out.flush()

        drafter = make_draft_model(target, draft)
        policy = k or policy_for(target, drafter)
        if tuned:  # the profile's drafter for this kind of prompt, k adaptive
            drafter, policy = tuned_drafter(tuned, CATEGORY[kind] if CATEGORY[kind] in tuned.categories else None,
                                            drafter)
        spec_tokens, spec = _run(target, prompt_ids, stop, drafter, policy, show)
        plain_tokens, plain = _run(target, prompt_ids, stop)
        choice = policy.describe() if isinstance(policy, AdaptiveK) else f"k = {policy}"
        rows.append({"kind": kind, "plain_tokens_per_s": plain.tokens_per_s, "spec_tokens_per_s": spec.tokens_per_s,
                     "speedup": plain.wall_s / spec.wall_s * len(spec_tokens) / max(1, len(plain_tokens)),
                     "acceptance_rate": spec.acceptance_rate, "mean_accepted_length": spec.mean_accepted_length,
                     "identical": spec_tokens == plain_tokens, "choice": f"{drafter.name}, {choice}"})
    print(f"\n\n{'kind':<10} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'α':>5} {'τ':>5}  identical",
          file=out)
    for r in rows:
        print(f"{r['kind']:<10} {r['plain_tokens_per_s']:>11.2f} {r['spec_tokens_per_s']:>10.2f} "
              f"{r['speedup']:>7.2f}x {r['acceptance_rate']:>5.2f} {r['mean_accepted_length']:>5.2f}  "
              f"{'yes' if r['identical'] else 'NO'}", file=out)
    for r in rows:
        print(f"{r['kind']:<10} {r['choice']}", file=out)
    chosen = f"drafter and k from {profile}" if tuned else f"draft model, k = {k}" if k else \
        "draft model, k chosen each round from this machine's measured costs"
    print(f"({chosen}; greedy, {max_new_tokens} new tokens at most; single runs, so timings are indicative)", file=out)
    return rows
