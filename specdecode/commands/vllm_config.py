"""A tuned profile as vLLM's `--speculative-config`, per category.

`specdecode tune` measures, on this machine, which drafter pays per kind of prompt and at
what draft length; vLLM takes the same choice as a JSON object. Prompt lookup is vLLM's
`ngram` method (our lookup matches the last 1 to 3 tokens, vLLM's `prompt_lookup_min/max`);
a draft model is named by its publisher's id; the lookup-or-model hybrid and drafting off
have no vLLM equivalent and say so. The lengths are this machine's: a GPU verifies more
tokens per pass for free, so they are a floor there, not an optimum.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.drafters.prompt_lookup import PromptLookup
from specdecode.models.registry import REGISTRY
from specdecode.options import HYBRID


def speculative_config(drafter: str, k: int, draft: str | None) -> dict:
    """{"speculative_config": ...} for one choice, or {"speculative_config": None, "why": ...}."""
    if not k:
        return {"speculative_config": None, "why": "no drafter paid for these prompts here: serve without one"}
    if drafter == "prompt-lookup":
        lookup = PromptLookup()
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                       "prompt_lookup_min": lookup.min_ngram, "prompt_lookup_max": lookup.max_ngram}}
    if drafter == "draft-model":
        spec = REGISTRY.get(draft or "")
        return {"speculative_config": {"model": spec.origin if spec is not None and spec.origin else draft,
                                       "num_speculative_tokens": k}}
    if drafter == HYBRID:
        return {"speculative_config": None, "why": "vLLM has no lookup-or-model drafter; the best single one is "
                                                   "in this category's alternatives"}
    return {"speculative_config": None, "why": f"{drafter} has no vLLM equivalent here"}


def for_profile(profile) -> dict[str, dict]:
    """Per category of a policy.profile.Profile, the speculative_config of the choice tune
    made and, as alternatives, of each single drafter it measured at that one's best length."""
    out = {}
    for name, c in profile.categories.items():
        def config(drafter: str, k: int) -> dict:
            return speculative_config(drafter, k, (profile.drafters.get(drafter) or {}).get("draft"))

        entry = config(c["drafter"], c["k"]) | {"expected_speedup_here": c["expected_speedup"]}
        entry["alternatives"] = {
            d: config(d, profile.best(d, alpha, c["rounds"].get(d))[0]) | {
                "expected_speedup_here": round(profile.best(d, alpha, c["rounds"].get(d))[1], 3)}
            for d, alpha in c["alpha"].items() if d != c["drafter"]}
        out[name] = entry
    return out


def write(profile, path) -> "Path":
    """`for_profile` as JSON at `path` (beside the profile), written whole or not at all."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"target": profile.target, "measured_on_this_machine": True,
                                   "categories": for_profile(profile)}, indent=1) + "\n")
    partial.replace(path)
    return path
