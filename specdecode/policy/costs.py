"""What drafting costs on this machine: timed target passes over n tokens (the verify
curve v(n)), the extra cost of a tree's paths, and the cost model built from them.

Passes are timed interleaved (every size once, then again) so that a noisy neighbour slows
them all alike and the ratios hold; medians after a warm-up round.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdecode.core.trees import build_tree, chain_tree, tree_attention
from specdecode.policy.adaptive import CostModel

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
    kernel in one call (models/attention_host.h). Timed as a star of num_leaves
    children of the root against a chain of as many tokens, interleaved."""
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


def cost_model(verify_seconds: dict[int, float], draft_step_s: float, catch_up_token_s: float = 0.0) -> CostModel:
    """Ratios to one plain step, with the curve filled in linearly between measured sizes;
    catch_up_token_s: the draft's pass per context token it reads (0: not measured)."""
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
    return CostModel(draft_ratio=draft_step_s / one, verify_ratios=tuple(ratios), catch_up_ratio=catch_up_token_s / one)
