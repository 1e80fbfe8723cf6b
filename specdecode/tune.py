"""`specdecode tune`: measure what drafting costs and brings, and choose k per category.

It measures, on this machine and in one process:
- the target's verify-cost curve: time of one pass over n tokens, n = 1..64;
- the drafter's cost per draft token (a draft model's one-token pass; prompt lookup ~0);
- per category, the per-position acceptance α (the geometric maximum-likelihood estimate
  from greedy generations at a probing k) on the built-in suites or a prompt file.
Then, per category, it picks the k that maximises expected tokens per second under the
cost model of adaptive.py, or "off" when no k beats plain decoding, and saves a profile
(JSON) that `generate --profile`, `demo --profile` and the API use: the profile's cost
model and the category's α seed the adaptive policy, which then follows the acceptance it
observes.

Left out: sampling-temperature-specific acceptance (measured greedy), tree shapes.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .adaptive import AdaptiveK, CostModel, best_k
from .errors import SpecDecodeError

VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 24, 32, 48, 64)


def time_pass(model, num_tokens: int, context: int = 256, repeats: int = 5) -> float:
    """Median seconds of one forward over num_tokens after `context` cached tokens."""
    cache = model.new_cache(1, context + num_tokens + 1)
    model(torch.randint(0, 1000, (1, context)), cache, num_logits=1)
    tokens = torch.randint(0, 1000, (1, num_tokens))
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        model(tokens, cache)
        times.append(time.perf_counter() - started)
        cache.rewind(num_tokens)
    return statistics.median(times[1:])


def measure_verify_curve(model, sizes=VERIFY_SIZES, context: int = 256, repeats: int = 5) -> dict[int, float]:
    return {n: time_pass(model, n, context, repeats) for n in sizes}


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
    """Per-position acceptance from rounds: accepted / (accepted + rounds that rejected)."""
    accepted = sum(num_accepted)
    rejections = sum(1 for d, a in zip(num_drafted, num_accepted) if d and a < d)
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


@dataclass
class Profile:
    target: str
    drafter: str  # "draft-model" or "prompt-lookup"
    draft: str | None
    dtype: str
    verify_seconds: dict[int, float]
    draft_step_s: float
    k_max: int = 8
    categories: dict[str, dict] = field(default_factory=dict)  # name -> {alpha, k, expected_speedup}

    @property
    def costs(self) -> CostModel:
        return cost_model(self.verify_seconds, self.draft_step_s)

    def decide(self, category: str, alpha: float) -> dict:
        k, speedup = best_k(alpha, self.costs, self.k_max)
        self.categories[category] = {"alpha": round(alpha, 4), "k": k, "expected_speedup": round(speedup, 3)}
        return self.categories[category]

    def overall_alpha(self) -> float:
        alphas = [c["alpha"] for c in self.categories.values()]
        return statistics.mean(alphas) if alphas else 0.6

    def policy(self, category: str | None = None) -> AdaptiveK:
        """An adaptive policy seeded with this profile's costs and the category's α."""
        if category is not None and category not in self.categories:
            raise SpecDecodeError(f"the profile has no category {category!r}; it has {', '.join(self.categories)}")
        alpha = self.categories[category]["alpha"] if category else self.overall_alpha()
        return AdaptiveK(self.costs, k_max=self.k_max, prior_alpha=alpha)

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
            raise SpecDecodeError(f"{path} is not a specdecode profile: {e}") from None


def drafter_step_seconds(drafter, context: int = 256, repeats: int = 5) -> float:
    """Seconds per draft token: a draft model's one-token pass, or a prompt-lookup scan."""
    if hasattr(drafter, "model"):
        return time_pass(drafter.model, 1, context, repeats)
    tokens = torch.randint(0, 1000, (context,)).tolist()
    started = time.perf_counter()
    for _ in range(repeats):
        drafter.propose(tokens, 8)
    return (time.perf_counter() - started) / (repeats * 8)


def run_tune(target_name: str, drafter_kind: str | None, draft_name: str | None, questions, max_new_tokens: int = 64,
             probe_k: int = 8, k_max: int = 8, log=print) -> Profile:
    """Measure costs and per-category acceptance; return the profile (not yet saved)."""
    from tqdm import tqdm

    from .api import load_model, make_drafter
    from .engine import decode
    from .events import Round
    from .prompts import encode_prompt
    from .stopping import StopCondition

    target = load_model(target_name)
    drafter = make_drafter(target, drafter_kind, draft_name, None)
    if drafter is None:
        raise SpecDecodeError("tune needs a drafter: --draft NAME or --drafter prompt-lookup")
    log("measuring the target's pass over n = 1..64 tokens and the drafter's step")
    profile = Profile(target_name, drafter.name, draft_name if drafter.name == "draft-model" else None,
                      str(target.model.dtype).removeprefix("torch."), measure_verify_curve(target.model),
                      drafter_step_seconds(drafter), k_max=k_max)
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=max_new_tokens)
    by_category: dict[str, list] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    bar = tqdm(total=len(questions), desc="acceptance", unit="prompt")
    for category, qs in by_category.items():
        drafted, accepted = [], []
        for q in qs:
            bar.set_postfix_str(category)
            prompt_ids = encode_prompt(target.tokenizer, q.turns[0])
            for event in decode(target.model, prompt_ids, stop, drafter=drafter, k=probe_k):
                if isinstance(event, Round) and event.num_drafted:
                    drafted.append(event.num_drafted)
                    accepted.append(event.num_accepted)
            bar.update()
        choice = profile.decide(category, alpha_mle(drafted, accepted))
        log(f"{category}: α {choice['alpha']:.2f} -> k = {choice['k'] or 'off'}, "
            f"expected {choice['expected_speedup']:.2f}x")
    bar.close()
    return profile


def default_profile_path(target_name: str, drafter_name: str, draft_name: str | None) -> Path:
    from .models.store import home

    name = f"{target_name}+{draft_name or drafter_name}".replace("/", "_")
    return home() / "profiles" / f"{name}.json"
