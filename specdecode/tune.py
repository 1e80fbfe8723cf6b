"""`specdecode tune`: measure what drafting costs and brings; choose drafter and k per category.

It measures, on this machine and in one process:
- the target's verify-cost curve: time of one pass over n tokens, n = 1..64;
- per category and drafter, greedy generations at a probing k on the built-in suites or a
  prompt file, which give the rounds (drafted, accepted), the per-position acceptance α
  (geometric maximum-likelihood estimate) and what drafting really costs per draft token
  in a generation (a draft model's passes, its catch-up pass included; prompt lookup ~0).
  A drafter's pass timed alone costs about half of that, which made `tune` overrate the
  draft model (session 2), so the in-generation figure is the one used.
Then, per category, it picks the drafter and k that maximise expected tokens per second,
computed from the observed rounds (adaptive.speedup_from_rounds; no i.i.d. assumption, so
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

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .adaptive import AdaptiveK, CostModel, best_k, best_k_from_rounds
from .drafters.hybrid import LookupOrModel
from .errors import SpecDecodeError

HYBRID = "hybrid"  # prompt lookup where the context repeats, else the draft model (drafters/hybrid.py)
TUNABLE = ("draft-model", "prompt-lookup", HYBRID)  # chain drafters; trees are shaped when trained
HYBRID_MIN_NGRAMS = (2, 3)  # tune probes the hybrid copying repeats of at least 2, and of at least 3


@dataclass(frozen=True)
class HybridK:
    """The hybrid drafter's draft lengths: a fixed one for copies, the model's policy; and
    the shortest repeat it copies."""
    lookup_k: int
    model: AdaptiveK | int
    min_ngram: int = 2


VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 24, 32, 48, 64)


def measure_passes(models: dict[str, tuple[object, int]], context: int = 256, repeats: int = 7) -> dict[str, float]:
    """Median seconds of one forward per (name -> (model, num_tokens)) after `context`
    cached tokens, measured interleaved (every pass once, then again) so that a noisy
    neighbour slows them all alike and the ratios hold."""
    caches = {}
    for name, (model, n) in models.items():
        key = id(model)
        if key not in caches:
            longest = max(m for mod, m in models.values() if mod is model)
            caches[key] = model.new_cache(1, context + longest + 1)
            model(torch.randint(0, model.vocab_size, (1, context)), caches[key], num_logits=1)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats + 1):  # the first round is a warm-up
        for name, (model, n) in models.items():
            cache, tokens = caches[id(model)], torch.randint(0, model.vocab_size, (1, n))
            started = time.perf_counter()
            model(tokens, cache)
            times[name].append(time.perf_counter() - started)
            cache.rewind(n)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def measure_verify_curve(model, sizes=VERIFY_SIZES, context: int = 256, repeats: int = 7) -> dict[int, float]:
    """The target's pass over n tokens, n in sizes, interleaved."""
    seconds = measure_passes({str(n): (model, n) for n in sizes}, context, repeats)
    return {n: seconds[str(n)] for n in sizes}


def measure_leaf_cost(model, num_leaves: int = 8, context: int = 256, repeats: int = 5) -> float:
    """Seconds each root-to-leaf path beyond the first adds to a tree pass: on torch's
    attention a tree pass attends once per path (models/path_attention.py), on the bf16
    kernel in one call (models/attention.cpp). Timed as a star of num_leaves
    children of the root against a chain of as many tokens, interleaved."""
    from .trees import build_tree, chain_tree, tree_attention

    cache = model.new_cache(1, context + num_leaves + 2)
    model(torch.randint(0, model.vocab_size, (1, context)), cache, num_logits=1)
    shapes = {"star": build_tree([(i,) for i in range(num_leaves)]), "chain": chain_tree(num_leaves)}
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(repeats + 1):  # the first round is a warm-up
        for name, tree in shapes.items():
            positions, mask = tree_attention(tree, cache.length)
            tokens = torch.randint(0, model.vocab_size, (1, tree.num_nodes))
            started = time.perf_counter()
            model(tokens, cache, positions=positions, mask=mask)
            times[name].append(time.perf_counter() - started)
            cache.rewind(tree.num_nodes)
    star, chain = (statistics.median(times[name][1:]) for name in shapes)
    return max(0.0, (star - chain) / (num_leaves - 1))


def cost_model(verify_seconds: dict[int, float], draft_step_s: float) -> CostModel:
    """Ratios to one plain step, with the curve filled in linearly between measured sizes."""
    sizes = sorted(verify_seconds)
    one = verify_seconds[1]
    ratios = []
    for n in range(1, sizes[-1] + 1):
        lo = max(s for s in sizes if s <= n)
        hi = min(s for s in sizes if s >= n)
        t = verify_seconds[lo] if lo == hi else verify_seconds[lo] + (
            verify_seconds[hi] - verify_seconds[lo]) * (n - lo) / (hi - lo)
        # A longer pass never costs less: timing noise must not make drafting look free.
        ratios.append(max([t / one, 1.0] + ratios[-1:]))
    return CostModel(draft_ratio=draft_step_s / one, verify_ratios=tuple(ratios))


def alpha_mle(num_drafted: list[int], num_accepted: list[int]) -> float:
    """Per-position acceptance from rounds: accepted / (accepted + rounds that rejected).

    A round that drafted nothing (prompt lookup found no match) counts as a rejection at
    the first position: like one, it emits a single token for about a plain step's cost.
    """
    accepted = sum(num_accepted)
    rejections = sum(1 for d, a in zip(num_drafted, num_accepted) if a < d or d == 0)
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


@dataclass
class Profile:
    """What `tune` measured and chose: verify costs, each drafter's cost, and per category
    each drafter's α and the (drafter, k) with the highest expected tokens per second."""

    target: str
    dtype: str
    verify_seconds: dict[int, float]
    # name -> {"draft": model name or None, "step_s": seconds per draft token in a generation,
    #          "step_s_alone": its pass timed alone}
    drafters: dict[str, dict]
    k_max: int = 8
    # name -> {"alpha": {drafter: α}, "rounds": {drafter: [[drafted, accepted], ...]},
    #          "drafter": best drafter, "k": its k (0 = off), "expected_speedup"}
    categories: dict[str, dict] = field(default_factory=dict)

    # Below this draft cost (a fraction of a target step) drafting is free, as prompt lookup's
    # is: its k is fixed from the rounds, since α-based adaptation undervalues its bursts.
    FREE_DRAFT = 0.02

    def costs(self, drafter: str) -> CostModel:
        return cost_model(self.verify_seconds, self.drafters[drafter]["step_s"])

    def best(self, name: str, alpha: float, rounds: list | None) -> tuple[int, float]:
        """(k, expected speedup) of a drafter: from its observed rounds, else from α."""
        if rounds:
            return best_k_from_rounds(rounds, self.costs(name), self.k_max)
        return best_k(alpha, self.costs(name), self.k_max)

    def decide(self, category: str, alphas: dict[str, float], rounds: dict[str, list] | None = None,
               hybrid: dict | None = None) -> dict:
        """Per category, the drafter and k that maximise expected speedup (k = 0: off).

        `hybrid` is the lookup-or-model drafter's probe (hybrid_probe): its parts' draft
        lengths and its emitted tokens and cost, in plain steps, over the probe's rounds."""
        rounds = rounds or {}
        options = {name: self.best(name, alpha, rounds.get(name)) for name, alpha in alphas.items()}
        if hybrid:
            options[HYBRID] = (hybrid["lookup_k"], hybrid["tokens"] / hybrid["cost"])
        name = max(options, key=lambda n: options[n][1])
        k, speedup = options[name]
        self.categories[category] = {"alpha": {n: round(a, 4) for n, a in alphas.items()},
                                     "rounds": {n: [list(r) for r in rs] for n, rs in rounds.items()},
                                     "drafter": name, "k": k, "expected_speedup": round(speedup, 3)}
        if hybrid:
            self.categories[category]["hybrid"] = hybrid
        return self.categories[category]

    def choose(self, category: str | None = None, drafter: str | None = None) -> tuple[str, AdaptiveK | int]:
        """(drafter, k) for a category, or for prompts of unknown kind (all categories'
        rounds pooled, or α averaged). `drafter` overrides the profile's pick. k is an
        adaptive policy seeded with the drafter's costs and α, or for a free drafter the
        fixed k its rounds favour."""
        if category is not None and category not in self.categories:
            raise SpecDecodeError(f"the profile has no category {category!r}; it has {', '.join(self.categories)}")
        if drafter is not None and drafter not in self.drafters:
            raise SpecDecodeError(f"the profile measured {', '.join(self.drafters)}, not {drafter!r}; "
                                  "run `specdecode tune` with it")
        chosen = self.categories.values() if category is None else [self.categories[category]]
        singles = [name for name in self.drafters if name != HYBRID]
        alphas = {name: statistics.mean(c["alpha"][name] for c in chosen) if chosen else 0.6 for name in singles}
        rounds = {name: [r for c in chosen for r in c.get("rounds", {}).get(name, [])] for name in singles}
        options = {name: self.best(name, alphas[name], rounds[name]) for name in singles}
        probes = [c["hybrid"] for c in chosen if "hybrid" in c]
        if probes:  # pooled: all its probe rounds' tokens over their cost
            options[HYBRID] = (probes[0]["lookup_k"], sum(p["tokens"] for p in probes) / sum(p["cost"] for p in probes))
        if drafter is None:
            drafter = max(options, key=lambda n: options[n][1])
        if drafter == HYBRID:
            if not probes:
                raise SpecDecodeError("the profile has no probe of the hybrid drafter; run `specdecode tune` with it")
            lookup_k = max(1, round(statistics.median(p["lookup_k"] for p in probes)))
            min_ngram = round(statistics.median(p.get("min_ngram", 2) for p in probes))
            return drafter, HybridK(lookup_k, self.choose(category, "draft-model")[1], min_ngram)
        k = options[drafter][0]
        if k > 0 and self.costs(drafter).draft_ratio < self.FREE_DRAFT:
            return drafter, k
        return drafter, AdaptiveK(self.costs(drafter), k_max=self.k_max, prior_alpha=alphas[drafter])

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(asdict(self), indent=1))
        partial.replace(path)  # never a half-written profile
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
            data["verify_seconds"] = {int(n): s for n, s in data["verify_seconds"].items()}
            return cls(**data)
        except FileNotFoundError:
            raise SpecDecodeError(f"no profile at {path}; `specdecode tune` writes one") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpecDecodeError(f"{path} is not a specdecode profile (or one from an older version; "
                                  f"run `specdecode tune` again): {e}") from None


def measure_costs(target, drafters: dict, context: int = 256, repeats: int = 7) -> tuple[dict[int, float], dict]:
    """(verify seconds by n, seconds per draft token by drafter), the model passes
    interleaved with the target's; prompt lookup is timed as a scan of the context."""
    models = {str(n): (target, n) for n in VERIFY_SIZES}
    models |= {name: (d.model, 1) for name, d in drafters.items() if hasattr(d, "model")}
    seconds = measure_passes(models, context, repeats)
    steps = {}
    for name, drafter in drafters.items():
        if hasattr(drafter, "model"):
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
    from tqdm import tqdm

    from .api import load_model, make_drafter
    from .engine import decode
    from .events import Round
    from .prompts import encode_prompt
    from .stopping import StopCondition

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


def default_profile_path(target_name: str, draft_name: str | None) -> Path:
    from .models.store import home

    name = f"{target_name}+{draft_name or 'prompt-lookup'}".replace("/", "_")
    return home() / "profiles" / f"{name}.json"
