"""The speculative decoding loop: prefill, then rounds of propose -> verify -> accept.

Each round the drafter proposes up to k tokens; the target runs once over the pending
token and the k drafts (k+1 positions, written into its cache); the acceptance rule keeps
a prefix of the drafts and adds one token of the target's own; the cache is rewound past
the rejected drafts. Without a drafter (or when it proposes nothing) a round is a plain
decoding step, so plain and speculative decoding share every line that decides tokens.

Cache invariant: the target's cache holds every context token except the last emitted
one, which is the first input of the next round.

A tree drafter (Medusa, EAGLE, a branching draft model) proposes a tree of candidates
instead (trees.py): the target runs once over the root and every node, each attending to
its ancestors only (tree attention masks and positions), the tree rule of acceptance.py
picks the longest accepted path, and `KVCache.compact` packs that path's slots so the
cache invariant holds again. For such a round, "drafted" counts the tree's depth, so α
is the acceptance per depth, comparable with a chain's per position.

Drafters that read the target's hidden states get them for every position the target
keeps (the prompt after prefill, then the root and the accepted path each round).

The loop yields `Round` events and a final `Done` (events.py); it never formats text.
Left out: batches of sequences.
The draft length of a chain may change every round: `k` is an int or a policy from
policy/adaptive.py; a tree drafter's tree is its own (k is ignored), and a drafter whose
`gate()` returns a policy/gate.TreeGate is switched off for the rounds where its trees do
not pay.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import torch

from specdecode.core.acceptance import greedy_chain, greedy_tree, one_hot_probs, rejection_chain, rejection_tree
from specdecode.core.draft_length import DraftLength, FixedK
from specdecode.errors import SpecDecodeError
from specdecode.core.events import Done, Round, Stats
from specdecode.core.prompts import check_fits
from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.core.stopping import StopCondition
from specdecode.core.trees import tree_attention


def decode(
    target,
    prompt_ids: Sequence[int],
    stop: StopCondition,
    sampling: SamplingConfig = SamplingConfig(),
    drafter=None,  # a drafters.base.Drafter or TreeDrafter; None: plain decoding
    k: int | DraftLength = 4,
    generator: torch.Generator | None = None,
) -> Iterator[Round | Done]:
    """k is a fixed draft length, or a policy (core/draft_length.py) asked for k before each
    round. The drafter is a drafters.base.Drafter (or TreeDrafter), or None for plain decoding."""
    is_tree = drafter is not None and drafter.is_tree
    if isinstance(k, int) and drafter is not None and k < 1 and not is_tree:
        raise SpecDecodeError(f"the draft length k must be >= 1, got {k}")
    policy = FixedK(k) if isinstance(k, int) else k
    k_max = drafter.max_nodes if is_tree else k if isinstance(k, int) else policy.k_max
    layers = drafter.target_layers if drafter is not None else ()
    if not prompt_ids:
        raise SpecDecodeError("the prompt is empty")
    check_fits(len(prompt_ids), stop.max_new_tokens, target.max_position_embeddings)
    started = time.perf_counter()
    stats = Stats(prompt_tokens=len(prompt_ids))
    if stop.max_new_tokens == 0:
        stats.wall_s = time.perf_counter() - started
        yield Done("length", stats)
        return

    room = min(len(prompt_ids) + stop.max_new_tokens + k_max + 1, target.max_position_embeddings)
    cache = target.new_cache(1, room)
    gate = None
    if drafter is not None:
        drafter.reset()  # a drafter that follows the target's features starts over with each generation
        gate = drafter.gate() if is_tree else None  # fresh per generation
    out = target(torch.tensor([list(prompt_ids)]), cache, num_logits=1, hidden_layers=layers)
    if layers:
        drafter.observe_target({layer: out.hidden_states[layer][0] for layer in layers})
    first = pick(out.logits[0], sampling, generator)[0]  # logits (1, V)
    stats.prefill_s = time.perf_counter() - started
    context = list(prompt_ids) + [first]
    new_tokens = [first]
    stats.new_tokens = 1
    keep, reason = stop.check(new_tokens, 0)
    yield Round((first,), 0, 0, 0.0, stats.prefill_s)

    while reason is None:
        t0 = time.perf_counter()
        budget = min(stop.max_new_tokens - len(new_tokens), cache.max_len - cache.length) - 1
        if is_tree:
            depth = budget if gate is None or gate.open() else 0  # depth 0: a plain step
            proposal = drafter.propose_tree(context, depth, sampling, generator)
            t1 = time.perf_counter()
            path, next_token = _verify_tree(target, cache, context[-1], proposal, sampling, generator, layers, drafter)
            num_drafted, num_accepted = proposal.tree.max_depth, len(path)
            if gate is not None and num_drafted:
                gate.observe(num_accepted)
            accepted_tokens = proposal.tokens[[node - 1 for node in path]].tolist()
        else:
            k_round = min(policy.next_k(drafter.unread(context), budget), budget) if drafter is not None else 0
            draft_tokens, draft_probs = propose(drafter, context, k_round, sampling, generator, budget)
            t1 = time.perf_counter()
            num_accepted, next_token = _verify(target, cache, context[-1], draft_tokens, draft_probs, sampling,
                                               generator)
            cache.rewind(len(draft_tokens) - num_accepted)
            policy.observe(len(draft_tokens), num_accepted)
            num_drafted, accepted_tokens = len(draft_tokens), draft_tokens[:num_accepted].tolist()
        t2 = time.perf_counter()
        if not is_tree:
            policy.observe_time(num_drafted, t2 - t0)

        emitted = accepted_tokens + [next_token]
        checked = len(new_tokens)
        new_tokens += emitted
        keep, reason = stop.check(new_tokens, checked)
        emitted = emitted[: keep - checked]
        del new_tokens[keep:]
        context += emitted
        stats.add_round(num_drafted, num_accepted, len(emitted), t1 - t0, t2 - t1)
        yield Round(tuple(emitted), num_drafted, min(num_accepted, len(emitted)), t1 - t0, t2 - t1)

    stats.wall_s = time.perf_counter() - started
    yield Done(reason, stats)


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator) -> list[int]:
    """Tokens for rows of logits (n, V): argmax when greedy, else a sample."""
    if sampling.greedy:
        return logits.argmax(dim=-1).tolist()
    return sample(logits_to_probs(logits, sampling), generator).tolist()


def propose(drafter, context: list[int], k: int, sampling: SamplingConfig, generator, tokens_left: int | None = None):
    if drafter is None or k < 1:
        return torch.empty(0, dtype=torch.long), None
    proposal = drafter.propose(context, k, sampling, generator, tokens_left=tokens_left)
    return proposal.tokens[:k], (None if proposal.probs is None else proposal.probs[:k])


def _verify(target, cache, pending: int, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
            sampling: SamplingConfig, generator) -> tuple[int, int]:
    """One target pass over [pending, drafts...]; returns (num_accepted, next_token)."""
    inputs = torch.cat([torch.tensor([pending]), draft_tokens])[None]  # (1, k+1)
    return accept_chain(draft_tokens, draft_probs, target(inputs, cache).logits[0], sampling, generator)


def accept_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                 sampling: SamplingConfig, generator) -> tuple[int, int]:
    """The acceptance rule over the target's logits (k+1, V) at [pending, drafts...]:
    (num_accepted, next_token). The batch loop (batch.py) decides with this same call."""
    if sampling.greedy:
        return greedy_chain(draft_tokens, logits.argmax(dim=-1))
    target_probs = logits_to_probs(logits, sampling)  # (k+1, V)
    if draft_probs is None:  # a deterministic drafter: all its mass on what it proposed
        draft_probs = one_hot_probs(draft_tokens, target_probs.shape[-1])
    return rejection_chain(draft_tokens, draft_probs, target_probs, generator)


def _verify_tree(target, cache, pending: int, proposal, sampling: SamplingConfig, generator, layers, drafter):
    """One target pass over the root and every node of the tree, each seeing only its
    ancestors; keeps the longest accepted path in the cache. Returns (path, next_token)."""
    tree = proposal.tree
    node_tokens = torch.cat([torch.tensor([pending]), proposal.tokens])  # (N+1,)
    start = cache.length
    if tree.num_nodes == 1:  # the root alone (the gate closed, or no tree pays here): a plain step's pass
        out = target(node_tokens[None], cache, hidden_layers=layers)
    else:
        positions, mask = tree_attention(tree, start)
        out = target(node_tokens[None], cache, positions=positions, mask=mask, hidden_layers=layers)
    logits = out.logits[0]  # (N+1, V)
    if sampling.greedy:
        path, next_token = greedy_tree(node_tokens, tree, logits.argmax(dim=-1))
    else:
        target_probs = logits_to_probs(logits, sampling)  # (N+1, V)
        draft_probs = proposal.probs
        if draft_probs is None:
            draft_probs = one_hot_probs(proposal.tokens, target_probs.shape[-1])
        root_row = draft_probs.new_zeros(1, draft_probs.shape[-1])  # the root's row, unused
        draft_probs = torch.cat([root_row, draft_probs])
        path, next_token = rejection_tree(node_tokens, tree, draft_probs, target_probs, generator)
    kept = [0] + list(path)
    cache.compact([start + node for node in kept])
    if layers:
        drafter.observe_target({layer: out.hidden_states[layer][0, kept] for layer in layers})
    return path, next_token
