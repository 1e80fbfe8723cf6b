"""A tuning profile: what `specdecode tune` measured on this machine (the verify curve,
each drafter's cost per draft token, per category the acceptance and rounds it saw) and
the (drafter, k) it chose per category. `generate --profile`, `demo --profile`, `bench
--methods tuned` and the API read it back; a draft model gets the adaptive policy seeded
with its measured costs and α.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.options import HYBRID
from specdecode.models.store import home
from specdecode.policy.adaptive import AdaptiveK, CostModel, best_k, best_k_from_rounds
from specdecode.policy.costs import cost_model



@dataclass(frozen=True)
class HybridK:
    """The hybrid drafter's draft lengths: a fixed one for copies, the model's policy; and
    the shortest repeat it copies."""
    lookup_k: int
    model: AdaptiveK | int
    min_ngram: int = 2


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


def default_profile_path(target_name: str, draft_name: str | None) -> Path:
    name = f"{target_name}+{draft_name or 'prompt-lookup'}".replace("/", "_")
    return home() / "profiles" / f"{name}.json"
