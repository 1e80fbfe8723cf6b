"""The Python API: `generate()` and `stream()` for a prompt, and a transformers-style model.

    >>> import specdecode
    >>> out = specdecode.generate("Write quicksort in Python.", draft="qwen2.5-coder-0.5b-instruct")
    >>> out.text, out.stats.mean_accepted_length

    >>> target = specdecode.load_model("qwen2.5-coder-1.5b-instruct")
    >>> ids = target.generate(**target.tokenizer("def fib(n):", return_tensors="pt"),
    ...                       prompt_lookup_num_tokens=4, max_new_tokens=64)

Loaded models are kept for the life of the process, keyed by (source, dtype, backend).
"""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .adaptive import AdaptiveK, CostModel, TreeGate
from . import draft_vocab, eagle, machine, medusa
from .drafters import DraftModel, PromptLookup, check_same_tokenizer
from .drafters.draft_tree import DraftTree
from .drafters.eagle import EagleDrafter
from .drafters.hybrid import LookupOrModel
from .drafters.medusa import MedusaDrafter
from .engine import decode
from .errors import SpecDecodeError
from .events import Done, Round, Stats, collect
from .models.load import ModelInfo, load
from .prompts import encode_prompt
from .sampling import SamplingConfig
from .stopping import StopCondition
from .tree_shapes import expected_tokens_of_tree
from .tune import HybridK, Profile

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DRAFTERS = ("draft-model", "prompt-lookup", "hybrid", "medusa", "draft-tree", "eagle")
# Top-2 at the first two depths, then top-1: 10 candidates, which with the root is the most
# rows a bf16 verify pass keeps row-invariant on oneDNN (models/linear.py; AMX: any number).
DEFAULT_TREE_WIDTHS = (2, 2, 1)
# Measured with `specdecode bench` on the Qwen pair (README): k = 2 was best or within 6% on
# every kind of prompt, where larger k lost up to 20% on prose.
DEFAULT_K = {"draft-model": 2, "prompt-lookup": 4}


@dataclass
class Model:
    """A loaded model with its tokenizer; `generate` mirrors transformers' signature."""

    model: object
    tokenizer: object
    info: ModelInfo

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 assistant_model: "Model | None" = None, prompt_lookup_num_tokens: int | None = None,
                 num_assistant_tokens: int | None = None, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 50, top_p: float = 1.0,
                 generator: torch.Generator | None = None, **unused) -> torch.Tensor:
        """Like transformers' `generate` for one sequence: returns (1, prompt + new) ids."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise SpecDecodeError(f"input_ids must be (1, T): one sequence, got {tuple(input_ids.shape)}")
        if assistant_model is not None and prompt_lookup_num_tokens is not None:
            raise SpecDecodeError("pass assistant_model= or prompt_lookup_num_tokens=, not both")
        prompt = input_ids[0][attention_mask[0].bool()] if attention_mask is not None else input_ids[0]
        sampling = SamplingConfig(temperature, top_k, top_p) if do_sample else SamplingConfig()
        drafter, k = None, 0
        if assistant_model is not None:
            drafter, k = make_draft_model(self, assistant_model), num_assistant_tokens or DEFAULT_K["draft-model"]
        elif prompt_lookup_num_tokens is not None:
            drafter, k = PromptLookup(), prompt_lookup_num_tokens
        stop = StopCondition(frozenset(self.info.eos_token_ids), max_new_tokens=max_new_tokens)
        new, _ = collect(decode(self.model, prompt.tolist(), stop, sampling, drafter, k, generator))
        return torch.cat([prompt, torch.tensor(new, dtype=torch.long)])[None]


@functools.lru_cache(maxsize=4)
def load_model(source: str = DEFAULT_TARGET, dtype: str | None = None, backend: str = "auto") -> Model:
    return Model(*load(source, dtype, backend))


def make_draft_model(target: Model, draft: Model) -> DraftModel:
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    return DraftModel(draft.model, target.model.vocab_size)


def make_drafter(target: Model, drafter: str | None, draft: str | None, dtype: str | None,
                 heads: str | None = None):
    """The drafter a front end asked for: a name, or a draft model's name (implies draft-model)."""
    if drafter is None and draft is None:
        if heads is not None:
            raise SpecDecodeError("--heads goes with --drafter medusa")
        return None
    if drafter is None:
        drafter = "draft-model"
    if drafter not in DRAFTERS:
        raise SpecDecodeError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    if draft is not None and drafter not in ("draft-model", "draft-tree", "hybrid"):
        raise SpecDecodeError(f"--draft names a draft model; it does not go with the {drafter} drafter")
    if heads is not None and drafter not in ("medusa", "eagle"):
        raise SpecDecodeError("--heads/--head goes with --drafter medusa or eagle")
    if drafter == "prompt-lookup":
        return PromptLookup()
    if drafter == "medusa":
        return make_medusa(target, heads)
    if drafter == "eagle":
        return make_eagle(target, heads)
    draft_model = make_draft_model(target, load_model(draft or DEFAULT_DRAFT, dtype))
    if drafter == "hybrid":  # without a profile: copies of up to 8, the model's k adaptive
        return LookupOrModel(draft_model, 8, AdaptiveK(CostModel(estimated_draft_ratio(target, draft_model))))
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


def make_medusa(target: Model, heads: str | None = None) -> MedusaDrafter:
    """Medusa heads from a folder, or the ones trained (or shipped) for this target."""
    folder = heads or medusa.find(target.info.source, target.info.folder)
    trained, config = medusa.load(folder)
    if config.target_sha256 and target.info.sha256 and config.target_sha256 != target.info.sha256:
        raise SpecDecodeError(f"the heads in {folder} were trained on {config.target} "
                              f"(sha256 {config.target_sha256[:12]}), not on this target")
    refitted = _fit_to_machine("Medusa heads' tree", "medusa", config.training.get("fitted_on"), heads,
                               lambda reshape: reshape.refit_medusa(target, Path(folder), log=lambda _: None))
    if refitted is not None:
        trained, config = medusa.load(refitted)
    paths = [tuple(p) for p in config.tree]
    gate = tree_gate(expected_tokens_of_tree(paths, config.accuracy), config.training.get("expected_speedup"))
    return MedusaDrafter(target.model, trained, paths, draft_vocab.for_target(target, trained.draft_vocab), gate)


def _fit_to_machine(what: str, kind: str, fitted_on: dict | None, given: str | None, refit) -> Path | None:
    """The folder of a tree drafter found for the target, fitted again to this machine
    (machine.py) because its shape was fitted on another: once, into the target's folder,
    where it is found the next time. None where it stays as it is: fitted here, or named by
    the user's path (a warning says how to refit it), or where the refit cannot be saved.
    refit(reshape module) does the fitting and returns the folder."""
    if not machine.fitted_elsewhere(fitted_on):
        return None
    if given is not None:
        warnings.warn(f"the {what} in {given} was fitted on another machine ({machine.describe(fitted_on)}); "
                      f"`specdecode train {kind} --reshape-only --from {given}` fits it to this one", stacklevel=3)
        return None
    print(f"fitting the {what} to this machine (once, under a minute; it was fitted on "
          f"{machine.describe(fitted_on)})...", file=sys.stderr, flush=True)
    from .training import reshape

    try:
        return refit(reshape)
    except OSError as e:  # a target folder we may not write to
        warnings.warn(f"the {what} fitted to this machine could not be saved ({e}); it runs as fitted", stacklevel=3)
        return None


def tree_gate(expected_tokens: float | None, expected_speedup: float | None) -> TreeGate | None:
    """The on/off gate of a tree drafter whose shape was chosen to emit `expected_tokens` a
    round at `expected_speedup`: a round costs their ratio in plain steps. None (always on)
    for an artifact that stores neither."""
    if not expected_tokens or not expected_speedup:
        return None
    return TreeGate(round_cost=expected_tokens / expected_speedup, prior_tokens=expected_tokens)


def plan(target: Model, drafter: str | None, draft: str | None, k: int | str | None, profile: str | None,
         category: str | None, dtype: str | None = None, heads: str | None = None):
    """(drafter, k or policy) for a request: a fixed k, "auto" (adaptive, costs estimated
    from sizes), or a tuning profile, which also picks the drafter unless one is named."""
    if profile is not None:
        if k is not None:
            raise SpecDecodeError("pass --k or --profile, not both: the profile chooses k")
        tuned = Profile.load(profile)
        if drafter not in (None, *tuned.drafters):
            raise SpecDecodeError(f"the profile measured {', '.join(tuned.drafters)}; pass --profile or "
                                  f"--drafter {drafter}, not both")
        name, _ = tuned.choose(category, drafter or ("draft-model" if draft else None))
        draft_model = None
        if name != "prompt-lookup":
            draft_model = make_draft_model(target, load_model(draft or tuned.drafters[name]["draft"], dtype))
        return tuned_drafter(tuned, category, draft_model, name)
    if category is not None:
        raise SpecDecodeError("--category selects a category of a --profile")
    if k is not None and drafter in ("medusa", "eagle"):  # before their heads load (and maybe refit)
        raise SpecDecodeError(f"--k does not apply to {drafter}: it verifies a tree chosen from measured acceptance")
    the_drafter = make_drafter(target, drafter, draft, dtype, heads)
    if hasattr(the_drafter, "propose_tree"):
        if k is not None:
            raise SpecDecodeError(f"--k does not apply to {the_drafter.name}: it verifies a tree chosen "
                                  "from measured acceptance")
        return the_drafter, 0
    if the_drafter is None:
        if k is not None:
            raise SpecDecodeError("--k needs a drafter (--draft, --drafter or --profile)")
        return None, 0
    if isinstance(the_drafter, LookupOrModel):
        if k is not None:
            raise SpecDecodeError("--k does not apply to the hybrid drafter: copies go up to 8 tokens and the "
                                  "draft model's k adapts")
        return the_drafter, the_drafter.k_max
    if k == "auto":
        return the_drafter, AdaptiveK(CostModel(draft_ratio=estimated_draft_ratio(target, the_drafter)))
    if isinstance(k, str):
        raise SpecDecodeError(f"k must be a number or 'auto', got {k!r}")
    return the_drafter, DEFAULT_K[the_drafter.name] if k is None else k


def estimated_draft_ratio(target: Model, drafter) -> float:
    """c before any measurement: decoding streams weights, so the ratio of weight bytes."""
    if isinstance(drafter, DraftModel):
        return drafter.model.weight_bytes_per_token / target.model.weight_bytes_per_token
    return 0.0  # prompt lookup: a scan of the context


def make_eagle(target: Model, head: str | None = None) -> EagleDrafter:
    """An EAGLE head from a folder, or the one trained (or shipped) for this target."""
    folder = head or eagle.find(target.info.source, target.info.folder)
    trained = eagle.load(folder)
    sha = trained.config.target_sha256
    if sha and target.info.sha256 and sha != target.info.sha256:
        raise SpecDecodeError(f"the head in {folder} was trained on {trained.config.target}, not on this target")
    refitted = _fit_to_machine("EAGLE head's tree", "eagle", trained.config.tree.get("fitted_on"), head,
                               lambda reshape: reshape.refit_eagle(target, Path(folder), log=lambda _: None))
    if refitted is not None:
        trained = eagle.load(refitted)
    shape = trained.config.tree  # chosen when training from measured acceptance and costs
    return EagleDrafter(target.model, trained, **{k: shape[k] for k in ("depth", "top_k", "num_nodes") if k in shape},
                        vocab=draft_vocab.for_target(target, trained.draft_vocab),
                        gate=tree_gate(shape.get("expected_tokens"), shape.get("expected_speedup")))


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


def stream(prompt: str | list[dict], target: str = DEFAULT_TARGET, *, draft: str | None = None,
           drafter: str | None = None, k: int | str | None = None, max_new_tokens: int = 256,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           stop: Sequence[str] = (), chat: bool = True, dtype: str | None = None,
           profile: str | None = None, category: str | None = None,
           heads: str | None = None) -> Iterator[Round | Done]:
    """Yields the engine's events: a `Round` per target pass, then `Done`.

    k: a draft length, or "auto" for the adaptive policy (adaptive.py) with costs estimated
    from the models' sizes. `profile` (a file from `specdecode tune`) picks the drafter
    that pays best on `category` (or on average) unless `drafter`/`draft` name one, and
    seeds the adaptive policy with its measured costs and acceptance. drafter="medusa" uses
    the heads in `heads` (a folder), else those `specdecode train medusa` made for `target`.
    """
    target_model = load_model(target, dtype)
    sampling = SamplingConfig(temperature, top_k, top_p)
    the_drafter, k = plan(target_model, drafter, draft, k, profile, category, dtype, heads)
    stop_condition = StopCondition(frozenset(target_model.info.eos_token_ids), tuple(stop), max_new_tokens,
                                   target_model.tokenizer)
    prompt_ids = encode_prompt(target_model.tokenizer, prompt, chat)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    yield from decode(target_model.model, prompt_ids, stop_condition, sampling, the_drafter, k, generator)


def generate(prompt: str | list[dict], target: str = DEFAULT_TARGET, **options) -> Generation:
    """Generate a reply; options as `stream`. Returns text, token ids, finish reason, stats."""
    tokens, done = collect(stream(prompt, target, **options))
    tokenizer = load_model(target, options.get("dtype")).tokenizer
    stop = StopCondition(stop_strings=tuple(options.get("stop", ())), tokenizer=tokenizer)
    return Generation(stop.cut_text(tokenizer.decode(tokens, skip_special_tokens=True)), tokens, done.reason, done.stats)
