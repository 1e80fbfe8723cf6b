"""Acceptance rules: which draft tokens a round keeps, and the one token the target adds.

Words (design.md):
  accepted tokens: the leading draft tokens the rule keeps.
  correction token: at the first rejected position i, a token sampled by the target from
      norm(max(0, target_probs[i] - draft_probs[i])); it replaces the rejected draft token.
  bonus token: when all k draft tokens are accepted, a token sampled from the target's
      extra position, target_probs[k].
Every round emits num_accepted + 1 tokens: the accepted ones, then `next_token` (the
correction or the bonus token).

Each rule is a pure function of tensors -> (num_accepted, next_token). No model, cache or
config goes in; randomness comes in as a `torch.Generator`, so a seed makes a round
repeatable. Probabilities are expected to come from `sampling.logits_to_probs` with the same
`SamplingConfig` for target and drafter.

Left out, for later in this module: batches of sequences (one sequence here), tree and
multi-candidate rules (several drafts per position), lossy rules (typical acceptance).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.sampling import sample


def one_hot_probs(tokens: Tensor, vocab_size: int) -> Tensor:
    """Draft probabilities (k, V) float32 for a deterministic drafter (prompt lookup, greedy
    draft model): all mass on the proposed token, so p_draft(proposed) = 1.

    tokens: (k,) long.
    """
    probs = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.float32, device=tokens.device)
    return probs.scatter_(1, tokens.long().unsqueeze(1), 1.0)  # (k, V)


def greedy_chain(draft_tokens: Tensor, target_tokens: Tensor) -> tuple[int, int]:
    """Greedy verification of a chain of k draft tokens.

    draft_tokens: (k,) long, the drafter's proposals for positions 0..k-1.
    target_tokens: (k+1,) long, the target's argmax at positions 0..k
        (`target_logits.argmax(-1)`; position k is the bonus position).

    Draft tokens are accepted while they equal the target's argmax. next_token is the
    target's argmax at the first mismatch (correction), or at position k (bonus) if all k
    are accepted. Returns (num_accepted, next_token); one host sync.
    """
    if target_tokens.dim() != 1:
        raise ValueError(f"target_tokens must be (k+1,), got {tuple(target_tokens.shape)}")
    k = _check_chain(draft_tokens, target_tokens.shape[0], "target_tokens")
    matches = draft_tokens == target_tokens[:k]  # (k,)
    num_accepted = matches.long().cumprod(0).sum()  # () leading run of matches
    next_token = target_tokens.gather(0, num_accepted.view(1))[0]  # ()
    n, token = torch.stack([num_accepted, next_token.long()]).tolist()
    return n, token


def rejection_chain(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) on a chain of k drafts.

    draft_tokens: (k,) long, draft token i was drawn from draft_probs[i].
    draft_probs: (k, V), the drafter's distribution at each draft position
        (`one_hot_probs(draft_tokens, V)` for a deterministic drafter).
    target_probs: (k+1, V), the target's distribution at positions 0..k.
    generator: the only source of randomness.

    Draft token i is accepted with probability min(1, target/draft) at that token (never if
    its draft probability is 0, see below); at the first rejection the correction token is
    sampled from norm(max(0, target_probs[i] - draft_probs[i])); if all k are accepted the
    bonus token is sampled from target_probs[k].
    The emitted tokens are then distributed exactly as sampling the target alone.
    k = 0 is allowed: nothing to verify, next_token is a sample from target_probs[0].

    The generator always advances by the same amount (k uniforms, then one row of V
    exponentials), whatever is accepted. Returns (num_accepted, next_token); one host sync.
    """
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be (k+1, V), got {tuple(target_probs.shape)}")
    k = _check_chain(draft_tokens, target_probs.shape[0], "target_probs")
    vocab_size = target_probs.shape[-1]
    if draft_probs.shape != (k, vocab_size):
        raise ValueError(
            f"draft_probs must be (k, V) = ({k}, {vocab_size}), got {tuple(draft_probs.shape)}"
        )

    draft_index = draft_tokens.unsqueeze(1)  # (k, 1)
    target_at_draft = target_probs[:k].gather(1, draft_index)[:, 0]  # (k,) p_target(draft token)
    draft_at_draft = draft_probs.gather(1, draft_index)[:, 0]  # (k,) p_draft(draft token)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device)  # (k,) in [0, 1)
    # u < p_target / p_draft, multiplied out so that 0/0 never happens. When p_target >=
    # p_draft this always holds (u < 1), when p_target = 0 it never does.
    # A draft token with p_draft = 0 could not have been drawn from draft_probs, so the rule's
    # premise is broken and no choice is lossless; we reject it (as vLLM does). That fails
    # safe: a drafter that forgot its probabilities (an all-zero row) gets residual =
    # target_probs[i] and the output is exactly the target's, at zero acceptance. Deterministic
    # drafters must pass one_hot_probs(draft_tokens, V), for which p_draft = 1.
    accepted = (uniforms * draft_at_draft < target_at_draft) & (draft_at_draft > 0)  # (k,)
    num_accepted = accepted.cumprod(0).sum()  # () length of the leading accepted run (int64)

    # The residual at row num_accepted; at the bonus position (num_accepted = k) the draft
    # row is taken as zeros, so the residual is the target row itself.
    row = num_accepted.view(1)  # (1,)
    target_row = target_probs.index_select(0, row)[0]  # (V,)
    if k == 0:
        draft_row = torch.zeros_like(target_row)
    else:
        last_draft = draft_probs.index_select(0, row.clamp(max=k - 1))[0]  # (V,)
        draft_row = last_draft * (num_accepted < k)  # (V,), zeros at the bonus position
    residual = (target_row - draft_row).clamp_min(0.0)  # (V,) unnormalised; sample() allows it
    # In exact arithmetic a rejection happens with probability sum(max(0, draft - target)),
    # which equals sum(max(0, target - draft)) = residual mass, so a rejection implies a
    # positive residual. In floating point, when the two rows agree up to rounding the
    # residual can come out as ~0 (or pure rounding noise). Falling back to the target row
    # then is harmless: this branch is reached with probability about equal to that residual
    # mass (<= float eps), so whatever is sampled here moves the output distribution by at
    # most that much, and the target row keeps the output inside the target's support.
    tiny_residual = residual.sum() <= torch.finfo(residual.dtype).eps
    next_token = sample(torch.where(tiny_residual, target_row, residual), generator)  # ()
    n, token = torch.stack([num_accepted, next_token]).tolist()
    return n, token


def _check_chain(draft_tokens: Tensor, num_target_positions: int, name: str) -> int:
    """Check that draft_tokens is (k,) and the target has k+1 positions; return k."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be (k,), got {tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[0]
    if num_target_positions != k + 1:
        raise ValueError(
            f"{name} must have k+1 = {k + 1} positions for k = {k} draft tokens, "
            f"got {num_target_positions}"
        )
    return k
