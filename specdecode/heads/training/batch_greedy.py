"""Greedy answers to many prompts at once: training text in the target's own words.

Heads learn what the target says next, so the best training text is the target's own
output: every label along it is consistent with the tokens before it. On real text the
target's prediction after position t+1 follows a token the target might never have
chosen, so the labels of heads that look two or more tokens ahead are partly noise.
Generating is the costly part on a CPU; a decoding step reads the weights once for any
number of rows, so answering B prompts together costs little more than answering one.

Rows are left-padded to the longest prompt. Each row has its own rotary positions and
an attention mask that hides its pad slots, so a row's tokens are those of decoding its
prompt alone (on the bf16 kernels a row's result does not depend on the other rows).
"""

from __future__ import annotations

import torch

from specdecode.heads.training.features import Features

LABEL_CHUNK = 256  # prompt rows per LM-head product when labelling the prompt


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (B, L), positions (B, L), mask (B, L, L)) of prompts left-padded to L.

    A pad slot sees only itself, so its keys are finite and no row is fully masked;
    a real token sees the real tokens of its own row up to itself."""
    L = max(map(len, prompts))
    pads = torch.tensor([L - len(p) for p in prompts])
    tokens = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts])
    slots = torch.arange(L)
    positions = (slots[None, :] - pads[:, None]).clamp(min=0)
    causal = slots[None, :] <= slots[:, None]  # (L, L) query, key
    real_key = slots[None, :] >= pads[:, None]  # (B, L)
    mask = causal[None] & real_key[:, None, :]
    mask |= torch.eye(L, dtype=torch.bool)[None] & ~real_key[:, :, None]  # a pad sees itself
    return tokens, positions, mask


def greedy_answers(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: frozenset[int]) -> list[list[int]]:
    """Each prompt's greedy answer, up to and including its first EOS, at most max_new_tokens."""
    return _decode(model, prompts, max_new_tokens, eos_ids, ())[0]


def answer_features(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: frozenset[int],
                    first_doc: int = 0, layers: tuple[int, ...] = ()) -> Features:
    """The target's features along prompt + its own answer, one document per prompt.

    Hidden states of the final (normed) layer and of `layers`, recorded while answering,
    so the answers need no second pass. Labels are the target's argmax at every position:
    on the prompt from its logits, on the answer the next answer token. An answer's last
    token is never fed, so it is a label only."""
    final = model.config.num_layers
    layers = tuple(sorted(set(layers) | {final}))
    answers, prompt_hidden, step_hidden = _decode(model, prompts, max_new_tokens, eos_ids, layers)
    tokens, labels, doc_ids, drafted = [], [], [], []
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    L = prompt_hidden[final].shape[1]
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        if not answer:
            continue
        along = {layer: torch.cat([prompt_hidden[layer][row, L - len(prompt):], step_hidden[layer][row, :len(answer) - 1]])
                 for layer in layers}
        h = along[final]
        prompt_labels = torch.cat([model.logits(chunk).argmax(dim=-1)
                                   for chunk in h[:len(prompt) - 1].split(LABEL_CHUNK)] + [torch.tensor(answer[:1])])
        tokens.append(torch.tensor(prompt + answer[:-1]))
        labels.append(torch.cat([prompt_labels, torch.tensor(answer[1:], dtype=torch.long)]))
        doc_ids.append(torch.full((len(h),), first_doc + row))
        for layer in layers:
            hidden[layer].append(along[layer].to(torch.bfloat16))
        drafted.append(torch.arange(len(h)) >= len(prompt) - 1)  # decoding drafts from here on
    return Features(torch.cat(tokens), torch.cat(labels), torch.cat(doc_ids),
                    {layer: torch.cat(h) for layer, h in hidden.items()}, torch.cat(drafted))


def _decode(model, prompts, max_new_tokens, eos_ids, layers: tuple[int, ...]):
    """(answers, the prompts' hidden states {layer: (B, L, H)}, each step's {layer: (B, steps, H)})
    of `layers`; the hidden states are None when no layer is asked for."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if not prompts or max_new_tokens <= 0:
        return [[] for _ in prompts], None, None
    tokens, positions, mask = left_padded(prompts)
    B, L = tokens.shape
    cache = model.new_cache(B, L + max_new_tokens)
    out = model(tokens, cache, positions=positions, mask=mask, num_logits=1, hidden_layers=layers)
    logits = out.logits[:, -1]
    prompt_hidden = out.hidden_states if layers else None
    steps = []  # {layer: (B, 1, H)} per step
    real_keys = mask[:, -1, :]  # (B, L): the slots a row's later tokens may see
    next_pos = positions[:, -1] + 1
    answers: list[list[int]] = [[] for _ in prompts]
    done = [False] * B
    for step in range(max_new_tokens):
        chosen = logits.argmax(dim=-1)
        for row, token in enumerate(chosen.tolist()):
            if not done[row]:
                answers[row].append(token)
                done[row] = token in eos_ids
        if all(done) or step == max_new_tokens - 1:
            break
        real_keys = torch.cat([real_keys, torch.ones(B, 1, dtype=torch.bool)], dim=1)
        out = model(chosen[:, None], cache, positions=next_pos[:, None], mask=real_keys[:, None, :],
                    hidden_layers=layers)
        logits = out.logits[:, -1]
        if layers:
            steps.append(out.hidden_states)
        next_pos = next_pos + 1
    if not layers:
        return answers, None, None
    return answers, prompt_hidden, {layer: torch.cat([s[layer] for s in steps], dim=1) if steps
                                    else prompt_hidden[layer][:, :0] for layer in layers}
