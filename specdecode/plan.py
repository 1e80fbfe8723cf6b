"""From what a front end asked for (flags or API arguments) to a drafter and its draft
length: a fixed k, the adaptive policy, or what a tuning profile chose. The arguments
were checked before any model loaded (options.check_request). Nothing here prints.
"""

from __future__ import annotations

from specdecode.drafters import DraftModel, PromptLookup, check_same_tokenizer
from specdecode.drafters.draft_tree import DraftTree
from specdecode.drafters.hybrid import LookupOrModel
from specdecode.errors import SpecDecodeError
from specdecode.options import DEFAULT_DRAFT, check_request
from specdecode.heads.loading import eagle_drafter, medusa_drafter
from specdecode.models.load import LoadedModel, load_model
from specdecode.policy.adaptive import AdaptiveK
from specdecode.policy.probe import measured_costs
from specdecode.policy.profile import HybridK, Profile

# Top-2 at the first two depths, then top-1: 10 candidates, which with the root is the most
# rows a bf16 verify pass keeps row-invariant on oneDNN (models/linear.py; AMX: any number).
DEFAULT_TREE_WIDTHS = (2, 2, 1)


def make_draft_model(target: LoadedModel, draft: LoadedModel) -> DraftModel:
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    return DraftModel(draft.model, target.model.vocab_size)


def make_drafter(target: LoadedModel, drafter: str | None, draft: str | None, dtype: str | None,
                 heads: str | None = None):
    """The drafter a front end asked for: a name, or a draft model's name (implies draft-model)."""
    check_request(drafter, draft, None, None, None, heads)
    if drafter is None and draft is None:
        return None
    drafter = drafter or "draft-model"
    if drafter == "prompt-lookup":
        return PromptLookup()
    if drafter == "medusa":
        return medusa_drafter(target, heads)
    if drafter == "eagle":
        return eagle_drafter(target, heads)
    draft_model = make_draft_model(target, load_model(draft or DEFAULT_DRAFT, dtype, as_draft=True))
    if drafter == "hybrid":
        return default_hybrid(target, draft_model)
    return DraftTree(draft_model, DEFAULT_TREE_WIDTHS) if drafter == "draft-tree" else draft_model


def tuned_drafter(profile: Profile, category: str | None, draft_model: DraftModel | None,
                  drafter: str | None = None):
    """(drafter, k or policy) that a tune profile picks for a category (None: any prompt).
    draft_model serves the draft-model and hybrid drafters."""
    name, policy = profile.choose(category, drafter)
    if name == "prompt-lookup":
        return PromptLookup(), policy
    if draft_model is None:
        raise SpecDecodeError(f"the profile picks the {name} drafter, which needs its draft model")
    if isinstance(policy, HybridK):
        hybrid = LookupOrModel(draft_model, policy.lookup_k, policy.model, policy.min_ngram)
        return hybrid, hybrid.k_max
    return draft_model, policy


def plan(target: LoadedModel, drafter: str | None, draft: str | None, k: int | str | None, profile: str | None,
         category: str | None, dtype: str | None = None, heads: str | None = None):
    """(drafter, k or policy) for a request: a fixed k; None or "auto": the adaptive policy
    on costs measured here; or a tuning profile, which also picks the drafter unless one
    is named."""
    check_request(drafter, draft, k, profile, category, heads)
    if profile is not None:
        tuned = Profile.load(profile)
        if drafter not in (None, *tuned.drafters):
            raise SpecDecodeError(f"the profile measured {', '.join(tuned.drafters)}; pass --profile or "
                                  f"--drafter {drafter}, not both")
        name, _ = tuned.choose(category, drafter or ("draft-model" if draft else None))
        draft_model = None
        if name != "prompt-lookup":
            draft_name = draft or tuned.drafters[name]["draft"]
            draft_model = make_draft_model(target, load_model(draft_name, dtype, as_draft=True))
        return tuned_drafter(tuned, category, draft_model, name)
    the_drafter = make_drafter(target, drafter, draft, dtype, heads)
    if the_drafter is None:
        return None, 0
    if the_drafter.is_tree:
        return the_drafter, 0
    if isinstance(the_drafter, LookupOrModel):
        return the_drafter, the_drafter.k_max
    if k is None or k == "auto":
        return the_drafter, policy_for(target, the_drafter)
    return the_drafter, k


# Prompt lookup's longest draft: copies cost nothing to propose, so on a long accepted run
# k may grow as far as the measured verify costs say it pays (16 tokens cost 1.1 steps with
# AMX, about 5 on a 2-core AVX2 CPU, where the policy stops near 8 by itself).
LOOKUP_K_MAX = 16


def policy_for(target: LoadedModel, drafter) -> AdaptiveK:
    """The default draft length of a chain drafter: the adaptive policy, seeded with the
    costs measured once on this machine (policy/probe.py), which drafts only as far as it
    pays and switches drafting off where it does not."""
    if isinstance(drafter, PromptLookup):
        return lookup_policy(target)
    return AdaptiveK(measured_costs(target.model, drafter.model if isinstance(drafter, DraftModel) else None))


def lookup_policy(target: LoadedModel) -> AdaptiveK:
    """Prompt lookup's adaptive length: free to draft, so up to LOOKUP_K_MAX, as far as the
    verify costs measured here pay."""
    rows = getattr(target.model, "row_invariant_rows", None)  # a pass past it would round differently
    k_max = LOOKUP_K_MAX if rows is None else min(LOOKUP_K_MAX, rows - 1)
    return AdaptiveK(measured_costs(target.model, None), k_max=k_max)


def default_hybrid(target: LoadedModel, draft_model: DraftModel) -> LookupOrModel:
    """The hybrid without a profile: each part's length adaptive, as it would be alone."""
    return LookupOrModel(draft_model, lookup_policy(target), policy_for(target, draft_model))
