"""Continuous batching: sequences join and leave a running batch between steps, and each
step is one target pass over all of them.

A sequence is prefilled alone when it joins (the very pass `engine.decode` makes), then
every step each sequence proposes its own chain of drafts (k may differ per sequence, 0
is a plain step), one pass verifies them all (models/batched.py: each sequence over its
own cache, rows computed independently), and each sequence accepts its own number of
tokens with the engine's acceptance rule and rewinds its own cache. A sequence's tokens
therefore depend on its prompt, its sampling settings and its own random generator only:
greedy output is token for token what `engine.decode` gives it alone, whatever shares
the batch.

The caller (a server's scheduler) decides who is in the batch and each sequence's k;
this module keeps no state besides the sequences themselves.
Left out: tree drafters (they run through `engine.decode`, one sequence at a time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.core.draft_length import DraftLength, FixedK
from specdecode.core.engine import accept_chain, pick, propose
from specdecode.core.events import Round, Stats
from specdecode.core.prompts import check_fits
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition
from specdecode.errors import SpecDecodeError
from specdecode.models.batched import SequencePass, forward_many
from specdecode.models.kv_cache import KVCache


@dataclass
class Sequence:
    """One generation in the batch: what decides its tokens, and where it stands."""

    prompt_ids: list[int]
    stop: StopCondition
    sampling: SamplingConfig = SamplingConfig()
    drafter: object = None  # a chain drafter (drafters.base.Drafter); None: plain decoding
    policy: DraftLength = field(default_factory=lambda: FixedK(0))  # told what each step accepted
    generator: torch.Generator | None = None
    k_max: int = 0  # the longest draft it may be asked for: its cache has room for it
    cache: KVCache | None = None
    context: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None  # "eos", "stop" or "length" once done

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def prefill(target, seq: Sequence) -> Round:
    """The sequence's prompt, alone, and its first token."""
    if seq.drafter is not None and seq.drafter.is_tree:
        raise SpecDecodeError("a batch takes chain drafters only; trees run one sequence at a time")
    if not seq.prompt_ids:
        raise SpecDecodeError("the prompt is empty")
    check_fits(len(seq.prompt_ids), seq.stop.max_new_tokens, target.max_position_embeddings)
    started = time.perf_counter()
    seq.stats = Stats(prompt_tokens=len(seq.prompt_ids))
    room = min(len(seq.prompt_ids) + seq.stop.max_new_tokens + seq.k_max + 1, target.max_position_embeddings)
    seq.cache = target.new_cache(1, room)
    if seq.drafter is not None:
        seq.drafter.reset()
    out = target(torch.tensor([seq.prompt_ids]), seq.cache, num_logits=1)
    first = pick(out.logits[0], seq.sampling, seq.generator)[0]
    seq.stats.prefill_s = time.perf_counter() - started
    seq.context = list(seq.prompt_ids) + [first]
    seq.new_tokens = [first]
    seq.stats.new_tokens = 1
    keep, seq.finish_reason = seq.stop.check(seq.new_tokens, 0)
    return Round((first,), 0, 0, 0.0, seq.stats.prefill_s)


def step(target, seqs: list[Sequence], ks: list[int]) -> list[Round]:
    """One round for every sequence: sequence i drafts up to ks[i] tokens (0: a plain
    step), one target pass verifies them all, each accepts its own. A Round per sequence."""
    if any(s.done or s.cache is None for s in seqs):
        raise SpecDecodeError("a batch step takes prefilled sequences that are not done")
    drafts, passes, draft_s, asked = [], [], [], []
    for seq, k in zip(seqs, ks):
        t0 = time.perf_counter()
        budget = min(seq.stop.max_new_tokens - len(seq.new_tokens), seq.cache.max_len - seq.cache.length) - 1
        k = min(k, budget, seq.k_max) if seq.drafter is not None else 0
        asked.append(k)
        tokens, probs = propose(seq.drafter, seq.context, k, seq.sampling, seq.generator)
        drafts.append((tokens, probs))
        passes.append(SequencePass([seq.context[-1]] + tokens.tolist(), seq.cache))
        draft_s.append(time.perf_counter() - t0)
    t1 = time.perf_counter()
    logits = forward_many(target, passes)
    verify_s = time.perf_counter() - t1
    rounds = []
    for seq, k, (tokens, probs), rows, d_s in zip(seqs, asked, drafts, logits, draft_s):
        num_accepted, next_token = accept_chain(tokens, probs, rows, seq.sampling, seq.generator)
        seq.cache.rewind(len(tokens) - num_accepted)
        # asked for drafts and given none (a lookup that found no match): told as one draft
        # rejected at once, so that the controller's α for it falls and it gets no rows
        seq.policy.observe(len(tokens) or int(k > 0), num_accepted)
        rounds.append(_emit(seq, tokens[:num_accepted].tolist() + [next_token], len(tokens), num_accepted, d_s,
                            verify_s))
    return rounds


def _emit(seq: Sequence, emitted: list[int], num_drafted: int, num_accepted: int, draft_s: float,
          verify_s: float) -> Round:
    """Append a round's tokens up to the stop condition, as engine.decode does."""
    checked = len(seq.new_tokens)
    seq.new_tokens += emitted
    keep, seq.finish_reason = seq.stop.check(seq.new_tokens, checked)
    emitted = emitted[: keep - checked]
    del seq.new_tokens[keep:]
    seq.context += emitted
    seq.stats.add_round(num_drafted, num_accepted, len(emitted), draft_s, verify_s)
    return Round(tuple(emitted), num_drafted, min(num_accepted, len(emitted)), draft_s, verify_s)
