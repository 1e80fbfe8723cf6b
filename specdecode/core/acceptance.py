"""Acceptance rules: which draft tokens a round keeps, and the one token the target adds.

Words (design.md):
  accepted tokens: the leading draft tokens the rule keeps.
  correction token: at the first rejected position i, a token sampled by the target from
      norm(max(0, target_probs[i] - draft_probs[i])); it replaces the rejected draft token.
  bonus token: when all k draft tokens are accepted, a token sampled from the target's
      extra position, target_probs[k].
Every round emits num_accepted + 1 tokens: the accepted ones, then `next_token` (the
correction or the bonus token).

Each rule is a pure function of tensors: the chain rules return (num_accepted,
next_token), the tree rules (several candidates per position, as a `trees.Tree`) return
(accepted node indices, next_token), the accepted nodes being one path down from the root.
No model, cache or config goes in; randomness comes in as a `torch.Generator`, so a seed
makes a round repeatable. Probabilities are expected to come from
`sampling.logits_to_probs` with the same `SamplingConfig` for target and drafter.

Left out, for later in this module: batches of sequences (one sequence here), lossy rules
(typical acceptance).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.core.sampling import sample
from specdecode.core.trees import Tree


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


def greedy_tree(node_tokens: Tensor, tree: Tree, target_tokens: Tensor) -> tuple[list[int], int]:
    """Greedy verification of a tree of draft candidates.

    node_tokens: (N+1,) long, the token at each node; node_tokens[0] is the root (the
        pending token), which is not judged.
    target_tokens: (N+1,) long, the target's argmax at each node, i.e. the token it would
        emit after that node's path (`tree_logits.argmax(-1)`).

    From the root, move to the first child (in rank order) whose token is the target's
    argmax at the current node; stop when no child has it. Every accepted token is thus the
    token plain greedy decoding would emit there, and next_token is the target's argmax at
    the last accepted node (the root if none): a correction, or the bonus token at a leaf.
    So the emitted tokens are exactly those of plain greedy decoding, however the tree is
    shaped. Returns (accepted node indices without the root, ascending, next_token); one
    host sync.
    """
    _check_tree_rows(node_tokens, tree, "node_tokens", 1)
    _check_tree_rows(target_tokens, tree, "target_tokens", 1)
    tokens, targets = torch.stack([node_tokens.long(), target_tokens.long()]).tolist()
    accepted: list[int] = []
    node = 0
    while True:
        wanted = targets[node]
        child = next((c for c in tree.children[node] if tokens[c] == wanted), None)
        if child is None:
            return accepted, targets[node]
        accepted.append(child)
        node = child


def rejection_tree(
    node_tokens: Tensor,
    tree: Tree,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Recursive rejection sampling over a tree of candidates (SpecInfer, Miao et al. 2024;
    in the without-replacement form of Jeon et al. 2024, "Recursive Speculative Decoding").

    node_tokens: (N+1,) long, the token at each node; node_tokens[0] (the root) is not judged.
    draft_probs: (N+1, V), row i = the distribution node i's token was actually drawn from,
        given its parent's path and its earlier-ranked siblings' tokens. I.i.d. sampling
        (with replacement) passes the same q for every sibling; sampling without
        replacement passes q with the earlier siblings' tokens removed and renormalised;
        deterministic candidates (top-k of a head, prompt lookup) pass one-hot rows
        (`one_hot_probs`). Row 0 is unused.
    target_probs: (N+1, V), the target's distribution at each node (after its path).
    generator: the only source of randomness.

    The rule. At the current node (first the root) the residual r starts as the target's
    row there. Each child c, in rank order, is accepted with probability
    min(1, r(x_c) / q_c(x_c)) (never if q_c(x_c) = 0, as in `rejection_chain`); on
    acceptance the walk moves to c and starts over with r = target_probs[c]; on rejection
    r becomes norm(max(0, r - q_c)) and the next child is tried. When every child is
    rejected, or the node is a leaf, next_token is sampled from r: a correction token, or
    the bonus token (r = the target's row) at a leaf whose every ancestor was accepted.

    Why the output is the target's. One candidate x ~ q judged against r, then a sample
    from norm(max(0, r - q)) on rejection, emits y with probability
        q(y) min(1, r(y)/q(y)) + (1 - sum_z min(r(z), q(z))) * max(0, r(y) - q(y)) / Z
      = min(r(y), q(y)) + max(0, r(y) - q(y)) = r(y),
    since the rejection probability 1 - sum min(r, q) equals the residual mass Z =
    sum max(0, r - q). This holds for any q, so each sibling may come from its own
    distribution: what matters is that, given everything that happened before it (its
    parent's path, the earlier siblings' tokens and their rejections), x_c is drawn from
    q_c and independently of the uniforms. Replacing "then sample from the residual" by
    "then judge the next sibling against the residual" keeps the output distributed as r
    (induction from the last sibling back to the first), so the first token emitted at a
    node is distributed as target_probs[node]. Given that the walk accepted c, the tokens
    after it come from the same procedure at c with the target's row after c's path; so the
    whole emitted sequence follows the target, exactly as sampling it alone would.

    The generator always advances by the same amount (N uniforms, node i using the
    (i-1)-th, then one row of V exponentials), whatever is accepted. With a chain tree this
    is `rejection_chain` step for step. Returns (accepted node indices without the root,
    ascending, next_token). Host syncs: one, plus one per child judged (at most N).
    """
    _check_tree_rows(node_tokens, tree, "node_tokens", 1)
    _check_tree_rows(target_probs, tree, "target_probs", 2)
    if draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs must be (N+1, V) = {tuple(target_probs.shape)} like target_probs, "
            f"got {tuple(draft_probs.shape)}"
        )
    num_nodes = tree.num_nodes
    tokens = node_tokens.long().to(draft_probs.device)  # (N+1,)
    uniforms = torch.rand(num_nodes - 1, generator=generator, device=target_probs.device)  # (N,)
    draft_at_token = draft_probs.gather(1, tokens.unsqueeze(1))[1:, 0]  # (N,) q_i(x_i)
    # As in rejection_chain, u < r/q is tested as u * q < r, so 0/0 never happens.
    scaled, draft_host = torch.stack([uniforms * draft_at_token, draft_at_token]).tolist()
    tokens_host = tokens.tolist()
    eps = torch.finfo(target_probs.dtype).eps

    accepted: list[int] = []
    node = 0
    residual = target_probs[0]  # (V,) r at the current node, normalised
    while True:
        moved = False
        for child in tree.children[node]:
            i = child - 1  # uniforms and draft_at_token skip the root
            if draft_host[i] > 0 and scaled[i] < float(residual[tokens_host[child]]):
                accepted.append(child)
                node, residual, moved = child, target_probs[child], True
                break
            left = (residual - draft_probs[child]).clamp_min(0.0)  # (V,) unnormalised
            mass = left.sum()
            # Rejection implies a positive residual in exact arithmetic; one of ~0 is rounding
            # reached with probability <= its mass (~eps). As in rejection_chain, fall back to
            # the target's row: harmless at that probability, and inside the target's support.
            residual = torch.where(mass <= eps, target_probs[node], left / mass)
        if not moved:
            break
    next_token = int(sample(residual, generator))
    return accepted, next_token


def _check_tree_rows(values: Tensor, tree: Tree, name: str, dim: int) -> None:
    """Check that values has `dim` dimensions and one row per node of the tree."""
    shape = "(N+1,)" if dim == 1 else "(N+1, V)"
    if values.dim() != dim or values.shape[0] != tree.num_nodes:
        raise ValueError(
            f"{name} must be {shape} with N+1 = {tree.num_nodes} (one row per node, the root "
            f"first), got {tuple(values.shape)}"
        )


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
