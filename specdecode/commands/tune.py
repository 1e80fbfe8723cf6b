"""`specdecode tune`: measure what drafting costs and brings; choose drafter and k per category.

It measures, on this machine and in one process:
- the target's verify-cost curve: time of one pass over n tokens, n = 1..64;
- per category and drafter, greedy generations at a probing k on the built-in suites or a
  prompt file, which give the rounds (drafted, accepted), the per-position acceptance α
  (geometric maximum-likelihood estimate) and what drafting really costs per draft token
  in a generation (a draft model's passes, its catch-up pass included; prompt lookup ~0).
  A drafter's pass timed alone costs about half of that, so the in-generation figure is
  the one used.
Then, per category, it picks the drafter and k that maximise expected tokens per second,
computed from the observed rounds (policy/adaptive.speedup_from_rounds; no i.i.d. assumption, so
prompt lookup's bursts count as they are), k = 0 ("off") when nothing beats plain decoding.
The hybrid (drafters/hybrid.py: copies where the context repeats, the draft model
elsewhere) is probed after its parts, at the lengths their rounds favour, copying
repeats of 2 and of 3 tokens or more; its rounds are charged what they cost as measured
(hybrid_probe), and the better of the two competes with the single drafters.
It saves a profile (JSON) that `generate --profile`, `demo --profile`, `bench --methods
tuned` and the API use: the category's drafter is built with the chosen k; a draft model
gets the adaptive policy seeded with its costs and α, which follows the acceptance it
observes and switches drafting off when it stops paying.

Left out: sampling-temperature-specific acceptance (measured greedy), tree shapes.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from specdecode.core.engine import decode
from specdecode.core.events import Round
from specdecode.core.prompts import encode_prompt
from specdecode.core.stopping import StopCondition
from specdecode.drafters import DraftModel
from specdecode.drafters.hybrid import LookupOrModel
from specdecode.errors import SpecDecodeError
from specdecode.plan import make_drafter
from specdecode.models.load import load_model
from specdecode.policy.adaptive import CostModel, best_k_from_rounds
from specdecode.policy.costs import VERIFY_SIZES, cost_model, measure_passes
from specdecode.options import HYBRID
from specdecode.policy.profile import Profile, alpha_mle

HYBRID_MIN_NGRAMS = (2, 3)  # tune probes the hybrid copying repeats of at least 2, and of at least 3


def measure_costs(target, drafters: dict, context: int = 256, repeats: int = 7) -> tuple[dict[int, float], dict]:
    """(verify seconds by n, seconds per draft token by drafter), the model passes
    interleaved with the target's; prompt lookup is timed as a lookup in the context."""
    models = {str(n): (target, n) for n in VERIFY_SIZES}
    models |= {name: (d.model, 1) for name, d in drafters.items() if isinstance(d, DraftModel)}
    seconds = measure_passes(models, context, repeats)
    steps = {}
    for name, drafter in drafters.items():
        if isinstance(drafter, DraftModel):
            steps[name] = seconds[name]
        else:
            tokens = torch.randint(0, 1000, (context,)).tolist()
            started = time.perf_counter()
            for _ in range(repeats):
                drafter.propose(tokens, 8)
            steps[name] = (time.perf_counter() - started) / (repeats * 8)
    return {n: seconds[str(n)] for n in VERIFY_SIZES}, steps


def run_tune(target_name: str, drafter_names: list[str], draft_name: str | None, questions,
             max_new_tokens: int = 64, probe_k: int = 8, k_max: int = 8, log=print) -> Profile:
    """Measure costs and per-category acceptance of each drafter; return the profile (not yet saved)."""
    if not drafter_names:
        raise SpecDecodeError("tune needs at least one drafter (--drafters)")
    if HYBRID in drafter_names and not {"draft-model", "prompt-lookup"} <= set(drafter_names):
        raise SpecDecodeError("tune probes the hybrid drafter after its parts: add draft-model and prompt-lookup "
                              "to --drafters")
    target = load_model(target_name)
    drafters = {name: make_drafter(target, name, draft_name if name == "draft-model" else None, None)
                for name in drafter_names if name != HYBRID}
    log("measuring the target's pass over n = 1..64 tokens and each drafter's step")
    verify, steps = measure_costs(target.model, drafters)
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=max_new_tokens)
    by_category: dict[str, list] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    observed: dict[str, dict[str, list]] = {}  # category -> drafter -> [(drafted, accepted)]
    hybrid_probes: dict[str, dict] = {}  # category -> hybrid_probe's figures
    draft_s = {name: 0.0 for name in drafters}
    drafted_total = {name: 0 for name in drafters}

    def probe(drafter, k, q) -> list:
        prompt_ids = encode_prompt(target.tokenizer, q.turns[0])
        return [e for e in decode(target.model, prompt_ids, stop, drafter=drafter, k=k)
                if isinstance(e, Round)][1:-1]  # not the prefill, nor the last (budget-cut) round

    def in_generation(name) -> float:  # what a draft token costs inside generation (catch-up included)
        return draft_s[name] / drafted_total[name] if drafted_total[name] else steps[name]

    runs = len(drafters) + (HYBRID in drafter_names) * len(HYBRID_MIN_NGRAMS)
    bar = tqdm(total=len(questions) * runs, desc="acceptance", unit="run")
    for category, qs in by_category.items():
        for name, drafter in drafters.items():
            for q in qs:
                bar.set_postfix_str(f"{category} / {name}")
                rounds = probe(drafter, probe_k, q)
                observed.setdefault(category, {}).setdefault(name, []).extend(
                    (r.num_drafted, r.num_accepted) for r in rounds)
                draft_s[name] += sum(r.draft_s for r in rounds)
                drafted_total[name] += sum(r.num_drafted for r in rounds)
                bar.update()
        if HYBRID in drafter_names:  # its parts at the lengths their own rounds favour
            seen = observed[category]
            lookup_k = best_k_from_rounds(seen["prompt-lookup"], cost_model(verify, in_generation("prompt-lookup")),
                                          k_max)[0] or probe_k // 2
            model_k = best_k_from_rounds(seen["draft-model"], cost_model(verify, in_generation("draft-model")),
                                         k_max)[0]
            for min_ngram in HYBRID_MIN_NGRAMS:  # how long a repeat must be before it is copied
                hybrid = LookupOrModel(drafters["draft-model"], lookup_k, model_k, min_ngram)
                rounds = []
                for q in qs:
                    bar.set_postfix_str(f"{category} / {HYBRID} n>={min_ngram}")
                    rounds += probe(hybrid, hybrid.k_max, q)
                    bar.update()
                found = hybrid_probe(rounds, cost_model(verify, 0.0), verify[1], lookup_k, model_k, min_ngram)
                best = hybrid_probes.get(category)
                if best is None or found["tokens"] / found["cost"] > best["tokens"] / best["cost"]:
                    hybrid_probes[category] = found
    bar.close()
    names = list(drafters) + ([HYBRID] if HYBRID in drafter_names else [])
    profile = Profile(target_name, str(target.model.dtype).removeprefix("torch."), verify,
                      {name: {"draft": draft_name if name in ("draft-model", HYBRID) else None,
                              "step_s": in_generation(name if name != HYBRID else "draft-model"),
                              "step_s_alone": steps[name if name != HYBRID else "draft-model"]} for name in names},
                      k_max=k_max)
    log("draft cost per token / target step: " + ", ".join(
        f"{n} {profile.costs(n).draft_ratio:.3f} (alone {steps[n] / verify[1]:.3f})" for n in drafters))
    for category, rounds in observed.items():
        alphas = {name: alpha_mle([d for d, _ in rs], [a for _, a in rs]) for name, rs in rounds.items()}
        choice = profile.decide(category, alphas, rounds, hybrid_probes.get(category))
        hybrid = hybrid_probes.get(category)
        log(f"{category}: α " + ", ".join(f"{n} {a:.2f}" for n, a in alphas.items())
            + (f", hybrid {hybrid['tokens'] / hybrid['cost']:.2f}x" if hybrid else "")
            + f" -> {choice['drafter']} k = {choice['k'] or 'off'}, expected {choice['expected_speedup']:.2f}x")
    return profile


def hybrid_probe(rounds, costs: CostModel, plain_step_s: float, lookup_k: int, model_k: int,
                 min_ngram: int = 2) -> dict:
    """The hybrid's expected speedup from its probe rounds, each charged what it cost: its
    drafting time as measured (a copy is free; a model draft pays its passes, catch-up
    included) plus the verify pass over its drafts, in plain steps."""
    tokens = sum(1 + r.num_accepted for r in rounds)
    cost = sum(r.draft_s / plain_step_s + costs.verify(r.num_drafted + 1) for r in rounds)
    return {"lookup_k": lookup_k, "model_k": model_k, "min_ngram": min_ngram, "rounds": len(rounds),
            "tokens": tokens, "cost": round(cost, 3) or 1.0}
