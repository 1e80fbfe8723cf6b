"""`specdecode train medusa`: train Medusa heads on a frozen target, by self-distillation.

1. Text (corpus.py) goes through the frozen target once (features.py): final hidden
   states and the target's own argmax after each position.
2. Head i at position t learns the target's prediction at t+1+i (its label there), from
   the hidden state at t: cross-entropy through the target's LM head. The softmax runs
   over the vocabulary that occurs among the labels (tens of thousands of rows instead of
   the whole table: the LM head is most of the cost on this CPU); candidates at run time
   come from the full LM head.
3. Documents are split 19:1 into training and held-out; the held-out loss is reported
   before and after, and the held-out top-rank accuracy of each head, conditioned on the
   earlier heads having their label among their top ranks, goes into the artifact: it
   chooses the tree (tree_shapes.py) with the verify cost measured on this machine.

Resumable: the features and a checkpoint (heads, optimizer, step) live in a work folder
beside the artifact; a rerun with the same settings continues where it stopped. The
artifact is written only at the end, by rename.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.heads.medusa import model as medusa
from specdecode.heads.draft_vocab import DraftVocab, lm_head_weight
from specdecode.errors import SpecDecodeError
from specdecode.heads.training.data import prepare
from specdecode.policy import machine
from specdecode.policy.costs import cost_model, measure_leaf_cost, measure_verify_curve
from specdecode.policy.tree_shapes import choose_tree
from specdecode.heads.training.loop import Checkpoint, bf16_is_fast, reduced_vocabulary, run_steps
from specdecode.heads.training.features import Features

MAX_TREE_NODES = 24  # a bound on the search; the measured verify curve decides the size


def max_tree_nodes(model) -> int:
    """The largest tree worth searching: MAX_TREE_NODES, or fewer where bf16 products keep
    rows bitwise independent only up to some count (oneDNN: 11 rows = root + 10 nodes)."""
    rows = getattr(model, "row_invariant_rows", None)
    return MAX_TREE_NODES if rows is None else min(MAX_TREE_NODES, rows - 1)
TOP_RANKS = 4
ACCURACY_POSITIONS = 4096  # held-out positions, spread over the set, that measure accuracy


@dataclass
class TrainConfig:
    num_heads: int = 3
    epochs: float = 2.0
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0
    checkpoint_every: int = 50
    bf16: bool = field(default_factory=bf16_is_fast)  # the LM-head product in bf16 (the heads stay fp32)


def head_labels(features: Features, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (T, K), valid (T, K)): head i at t learns the label at t+1+i, same document."""
    T = len(features)
    labels = torch.zeros(T, num_heads, dtype=torch.long)
    valid = torch.zeros(T, num_heads, dtype=torch.bool)
    for i in range(num_heads):
        shift = i + 1
        if shift >= T:
            break
        labels[:T - shift, i] = features.labels[shift:]
        valid[:T - shift, i] = features.doc_ids[shift:] == features.doc_ids[:T - shift]
    return labels, valid


def split(features: Features, held_out_every: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Position indices (train, held-out): one source in 20 is held out, by a hash of its
    name, with every document made from it; where sources are unknown, every 20th document.

    By source, because documents of one source share text: a module's functions are
    completed, edited, explained and tested, and its code is in the teacher-forced source.
    Split by document, the held-out answers were text the heads had nearly seen (Medusa's
    head 3 was right 0.60 of the time there, 0.29 on the bench's prompts), and the tree
    chosen from them was deeper than the heads could fill."""
    sources = features.sources
    if sources is not None and len(sources) == int(features.doc_ids.max()) + 1:
        held_sources = torch.tensor([zlib.crc32(s.encode()) % held_out_every == held_out_every - 1 for s in sources])
        held = held_sources[features.doc_ids]
    else:
        held = features.doc_ids % held_out_every == held_out_every - 1
    if not held.any():  # too few documents: hold out the last 5% of positions instead
        held = torch.arange(len(features)) >= int(len(features) * 0.95)
    return (~held).nonzero()[:, 0], held.nonzero()[:, 0]


def head_loss(heads, hidden, labels, valid, vocab_weight, vocab_index) -> torch.Tensor:
    """Mean cross-entropy of every valid (position, head) over the reduced vocabulary."""
    features = heads(hidden.float())  # (K, B, H)
    logits = (features.to(vocab_weight.dtype) @ vocab_weight.T).float()  # (K, B, Vr); bf16 product if bf16
    targets = vocab_index[labels.T].clamp_min(0)  # (K, B) rows of the reduced vocabulary; invalid ones masked
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    mask = valid.T.flatten().float()
    return (loss * mask).sum() / mask.sum().clamp_min(1.0)


@torch.no_grad()
def evaluate(heads, hidden, labels, valid, vocab_weight, vocab_index, batch: int = 1024) -> float:
    losses, weights = [], []
    for start in range(0, hidden.shape[0], batch):
        sl = slice(start, start + batch)
        n = valid[sl].sum().item()
        if n:
            losses.append(head_loss(heads, hidden[sl], labels[sl], valid[sl], vocab_weight, vocab_index).item() * n)
            weights.append(n)
    return sum(losses) / max(1, sum(weights))


@torch.no_grad()
def rank_accuracy(heads, target, vocab: DraftVocab, hidden, labels, valid,
                  top: int = TOP_RANKS) -> list[list[float]]:
    """accuracy[i][r]: P(head i's rank-r candidate is its label | heads before i had theirs
    in their top ranks), read through the draft vocabulary, on held-out positions."""
    features = heads(hidden.float()).to(target.dtype)  # (K, B, H)
    ranked = torch.stack([vocab.tokens(vocab.logits(f).topk(top, dim=-1).indices) for f in features])
    hits = ranked == labels.T[:, :, None]  # (K, B, top)
    accuracy, reach = [], valid[:, 0].clone()
    for i in range(heads.num_heads):
        reach &= valid[:, i]
        n = max(1, int(reach.sum()))
        accuracy.append([round(float(hits[i, reach, r].sum()) / n, 4) for r in range(top)])
        reach &= hits[i].any(dim=-1)
    return accuracy


def train(target, features: Features, lm_weight: torch.Tensor, config: TrainConfig, work: Path,
          log=print) -> tuple[medusa.MedusaHeads, dict]:
    """Train heads on the features; resumes from work/checkpoint.pt. Returns (heads, record)."""
    layer = max(features.hidden)
    hidden = features.hidden[layer]
    labels, valid = head_labels(features, config.num_heads)
    train_idx, held_idx = split(features)
    vocab_weight, vocab_index = reduced_vocabulary(features.labels, lm_weight,
                                                   torch.bfloat16 if config.bf16 else torch.float32)

    torch.manual_seed(config.seed)
    heads = medusa.MedusaHeads(config.num_heads, hidden.shape[-1])
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    steps_per_epoch = max(1, len(train_idx) // config.batch_size)
    total_steps = max(1, int(config.epochs * steps_per_epoch))
    order = torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(config.seed))
    checkpoint = Checkpoint(work / "medusa-checkpoint.pt", heads, optimizer, config, (len(features), len(held_idx)))
    step, record = checkpoint.resume()
    if step:
        log(f"resuming from step {step} of {total_steps}")
    held = (hidden[held_idx], labels[held_idx], valid[held_idx])
    if "held_out_loss_before" not in record:
        record["held_out_loss_before"] = round(evaluate(heads, *held, vocab_weight, vocab_index), 4)

    started = time.perf_counter()

    def loss_at(step: int) -> torch.Tensor:  # a batch of positions per step, an epoch in a fixed order
        offset = (step % steps_per_epoch) * config.batch_size
        batch = train_idx[order[offset:offset + config.batch_size]]
        return head_loss(heads, hidden[batch], labels[batch], valid[batch], vocab_weight, vocab_index)

    run_steps(loss_at, heads, optimizer, checkpoint, step, total_steps, config.lr, record, config.checkpoint_every,
              "train medusa")
    heads.eval()
    record |= {"held_out_loss_after": round(evaluate(heads, *held, vocab_weight, vocab_index), 4),
               "steps": total_steps, "train_positions": len(train_idx), "held_out_positions": len(held_idx),
               "reduced_vocab": vocab_weight.shape[0], "seconds_this_run": round(time.perf_counter() - started, 1)}
    heads.draft_vocab = torch.unique(features.labels)  # the rows its loss was trained on
    vocab = DraftVocab.rows(lm_weight, heads.draft_vocab, target.dtype)
    drafting = features.drafted_among(held_idx)  # where decoding drafts, when the data says
    sample = drafting[::max(1, len(drafting) // ACCURACY_POSITIONS)][:ACCURACY_POSITIONS]
    record["accuracy"] = rank_accuracy(heads, target, vocab, hidden[sample], labels[sample], valid[sample])
    return heads, record


def pick_tree(target, heads, vocab: DraftVocab, accuracy, log=print) -> tuple[list[tuple[int, ...]], float]:
    """The tree for these heads on this machine: measured verify cost and draft cost."""

    max_nodes = max_tree_nodes(target)
    verify = measure_verify_curve(target, sizes=tuple(range(1, max_nodes + 2)), repeats=3)
    leaf_ratio = measure_leaf_cost(target) / verify[1]
    draft_s = _time_draft(target, heads, vocab)
    costs = cost_model(verify, draft_s)
    paths, speedup = choose_tree(accuracy, costs.verify_ratios, costs.draft_ratio, max_nodes, leaf_ratio)
    log(f"tree of {len(paths)} nodes, expected {speedup:.2f}x (draft {costs.draft_ratio:.3f} of a step, "
        f"{leaf_ratio:.3f} per extra path)")
    return paths, speedup


def _time_draft(target, heads, vocab: DraftVocab, repeats: int = 5) -> float:
    """Seconds of a draft as MedusaDrafter runs it: packed heads in the target's dtype."""
    drafting = medusa.MedusaHeads(heads.num_heads, heads.weight.shape[-1])
    drafting.load_state_dict(heads.state_dict())
    drafting = drafting.to(target.dtype).pack_for_drafting()
    hidden = torch.randn(1, heads.weight.shape[-1]).to(target.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            started = time.perf_counter()
            vocab.logits(drafting(hidden)[:, 0]).topk(TOP_RANKS, dim=-1)
            times.append(time.perf_counter() - started)
    return sorted(times[1:])[repeats // 2]


def run_train_medusa(target_name: str, num_heads: int = 3, num_tokens: int = 100_000, num_answers: int = 24,
                     answer_tokens: int = 128, epochs: float = 2.0, out: str | Path | None = None,
                     log=print) -> Path:
    """Everything `specdecode train medusa` does; returns the artifact folder."""

    if num_heads < 1:
        raise SpecDecodeError("--heads must be positive")
    target, features, folder, work = prepare(target_name, out, medusa.default_dir, num_tokens, num_answers,
                                             answer_tokens, epochs, "Medusa", log)
    config = TrainConfig(num_heads=num_heads, epochs=epochs)
    lm_weight = lm_head_weight(target)
    heads, record = train(target.model, features, lm_weight, config, work, log)
    log(f"held-out loss {record['held_out_loss_before']:.3f} -> {record['held_out_loss_after']:.3f}; "
        f"top-1 accuracy by head {[a[0] for a in record['accuracy']]}")
    vocab = DraftVocab.rows(lm_weight, heads.draft_vocab, target.model.dtype)
    paths, speedup = pick_tree(target.model, heads, vocab, record["accuracy"], log)
    record["expected_speedup"] = round(speedup, 3)
    record["fitted_on"] = machine.fit_record(target.model)
    accuracy = record.pop("accuracy")
    artifact = medusa.MedusaConfig(target_name, target.info.sha256, heads.weight.shape[-1], num_heads,
                                   accuracy, [list(p) for p in paths], record)
    return medusa.save(folder, heads, artifact)
