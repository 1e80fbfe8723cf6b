"""The Python API: `generate()` and `stream()` for a prompt, and a transformers-style model.

    >>> import specdecode
    >>> out = specdecode.generate("Write quicksort in Python.", draft="qwen2.5-coder-0.5b-instruct")
    >>> out.text, out.stats.mean_accepted_length

    >>> target = specdecode.load_model("qwen2.5-coder-1.5b-instruct")
    >>> ids = target.generate(**target.tokenizer("def fib(n):", return_tensors="pt"),
    ...                       prompt_lookup_num_tokens=4, max_new_tokens=64)

Loaded models are kept for the life of the process, keyed by (source, dtype, backend).
Without a draft length, k comes from the adaptive policy (plan.py), which switches
drafting off where it does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from specdecode.core.engine import decode
from specdecode.core.events import Done, Round, Stats, collect
from specdecode.core.prompts import encode_prompt
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition
from specdecode.drafters import PromptLookup
from specdecode.errors import SpecDecodeError
from specdecode.models import load as models_load
from specdecode.models.load import LoadedModel
from specdecode.options import DEFAULT_TARGET, check_request
from specdecode.plan import make_draft_model, plan, policy_for


@dataclass(frozen=True)
class Model(LoadedModel):
    """A loaded model with its tokenizer; `generate` mirrors transformers' signature."""

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
            drafter = make_draft_model(self, assistant_model)
            k = num_assistant_tokens or policy_for(self, drafter)
        elif prompt_lookup_num_tokens is not None:
            drafter, k = PromptLookup(), prompt_lookup_num_tokens
        stop = StopCondition(frozenset(self.info.eos_token_ids), max_new_tokens=max_new_tokens)
        new, _ = collect(decode(self.model, prompt.tolist(), stop, sampling, drafter, k, generator))
        return torch.cat([prompt, torch.tensor(new, dtype=torch.long)])[None]


def load_model(source: str = DEFAULT_TARGET, dtype: str | None = None, backend: str = "auto",
               as_draft: bool = False) -> Model:
    """as_draft: the model will only draft (pass it as `assistant_model`); with quantized
    weights its LM head is then read at five bits where the file stores it wider."""
    loaded = models_load.load_model(source, dtype, backend, as_draft)
    return Model(loaded.model, loaded.tokenizer, loaded.info)


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

    k: a draft length, or None / "auto" for the adaptive policy (policy/adaptive.py) seeded
    with costs measured once on this machine. `profile` (a file from `specdecode tune`) picks the drafter
    that pays best on `category` (or on average) unless `drafter`/`draft` name one, and
    seeds the adaptive policy with its measured costs and acceptance. drafter="medusa" uses
    the heads in `heads` (a folder), else those `specdecode train medusa` made for `target`.
    """
    check_request(drafter, draft, k, profile, category, heads, dtype)
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
