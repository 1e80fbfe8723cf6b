"""`specdecode train eagle`: train an EAGLE head on a frozen target, by self-distillation.

Same data as Medusa (data.py: standard-library source and the target's own answers, run
once through the frozen target). Per document, the head reads the pairs
(f_j, embed(x_{j+1})) and learns f_{j+1}, the target's next feature (smooth L1), and
the target's own next-token prediction from it through the frozen LM head
(cross-entropy over the vocabulary that occurs among the labels). EAGLE weighs the token
loss 0.1; with the little data trained on here the token loss is what counts: on 60k
tokens of Qwen2.5-1.5B's features, 2 epochs, held-out top-1 rose from 0.31 (weight 0.1,
lr 3e-4) to 0.38 (weight 1, lr 1e-3); soft labels (the target's whole distribution)
gave 0.37. Documents are packed into steps of about 512 positions, each attending to
itself only, with the head's products in bf16 where the CPU has bf16 instructions (fp32
elsewhere). Every 20th document is held out; its loss
is reported before and after, with the top-1 accuracy of the token read from the
predicted feature. Resumable from a checkpoint in the work folder.
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from specdecode.heads.eagle import eagle3
from specdecode.heads.eagle import model as eagle
from specdecode.heads.eagle.parts import HeadCache
from specdecode.heads.draft_vocab import DraftVocab, lm_head_weight
from specdecode.errors import SpecDecodeError
from specdecode.heads.training.data import prepare
from specdecode.policy import machine
from specdecode.policy.costs import cost_model, measure_leaf_cost, measure_verify_curve
from specdecode.policy.tree_shapes import choose_tree, expected_tokens_of_tree
from specdecode.heads.training.loop import Checkpoint, bf16_is_fast, reduced_vocabulary, run_steps
from specdecode.heads.training.features import Features
from specdecode.heads.medusa.train import max_tree_nodes, split

TOKEN_LOSS_WEIGHT = 1.0


SHAPE_DOCUMENTS = 40  # held-out documents the tree shape is measured on


@dataclass
class EagleTrainConfig:
    epochs: float = 2.0
    lr: float = 1e-3
    seed: int = 0
    intermediate_size: int | None = None  # None: the target's
    checkpoint_every: int = 50
    rollout: int = 2  # steps on its own predicted features (packed_loss)
    token_weight: float = TOKEN_LOSS_WEIGHT
    tokens_per_step: int = 512  # documents packed per step (1,024 halves the steps an epoch, and lr 2e-3 diverges)
    # products in bf16 where that is fast: 2.2x faster than fp32 at 1024 positions on
    # Qwen2.5-1.5B's head with AMX; several times slower without bf16 instructions
    bf16: bool = field(default_factory=bf16_is_fast)
    feature_layers: tuple[int, ...] = ()  # the target layers a new head fuses (eagle.new_head); (): the final
    # "fused" (model.py) or "eagle3" (eagle3.py: the layout vLLM and SGLang load, which
    # learns tokens alone through its own LM head, started from the target's rows)
    layout: str = "fused"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: a low, a middle and a high layer (2, L/2, L-3)."""
    return tuple(sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)}))


def documents(features: Features, indices: torch.Tensor) -> list[torch.Tensor]:
    """Position indices of each document that has at least one of `indices`, in order."""
    chosen = set(features.doc_ids[indices].tolist())
    return [(features.doc_ids == d).nonzero()[:, 0] for d in sorted(chosen)]


def pack(lengths: Sequence[int], tokens_per_step: int) -> list[list[int]]:
    """Consecutive documents grouped so that each group has at most tokens_per_step
    positions (a longer document goes alone): one group is one training step."""
    groups, size = [], tokens_per_step
    for i, n in enumerate(lengths):
        if size + n > tokens_per_step:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def packed_loss(head, embed, features: Features, docs: Sequence[torch.Tensor], vocab_weight, vocab_index,
                rollout: int = 1, token_weight: float = TOKEN_LOSS_WEIGHT, bf16: bool = False):
    """(loss, top-1 hits, count) of documents packed into one head pass.

    Each document attends causally to itself only (a block-diagonal mask, positions from
    0 in each), so the loss is each document's alone, weighted by its length: one pass over
    many short documents keeps the products large, which is what this CPU is fast at.
    Step 1 reads the target's true features. Each further rollout step feeds the head its
    own predictions from the step before in their place (pair j gets f̂_j; a document's
    first pair keeps the true feature), so that it learns to draft deeper than one token
    from features it predicted itself; the loss is the mean over steps, the hits are
    step 1's. bf16: the head's products in bf16 (autocast), its weights and the losses fp32.
    An EAGLE-3 layout head learns the tokens alone, through its own LM head (its rows are
    the reduced vocabulary's, in the same order); the fused one also its next features.
    The EAGLE-3 head's rollout steps attend as drafting does (`chain_mask`, EAGLE-3's
    training-time test): to the true pairs up to their chain's root and to the chain; its
    states, unlike the fused head's features, are never pulled toward the true ones, so
    what a deeper node sees must be what it sees when drafting."""
    j = torch.cat([d[:-1] for d in docs])
    nxt = torch.cat([d[1:] for d in docs])
    doc = torch.cat([torch.full((len(d) - 1,), i) for i, d in enumerate(docs)])
    positions = torch.cat([torch.arange(len(d) - 1) for d in docs])
    mask = (doc[:, None] == doc[None]) & (positions[:, None] >= positions[None])
    first = (positions == 0)[:, None]
    embeds = embed[features.tokens[nxt]].float()
    final = max(features.hidden)
    target = features.hidden[final][nxt].float()
    labels = vocab_index[features.labels[nxt]]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        true_inputs = head.target_features({l: features.hidden[l][j].float() for l in head.layers(final)}, final)
    true_inputs = inputs = true_inputs.float()
    own_lm_head = head.config.layout == eagle3.LAYOUT
    cache = HeadCache() if own_lm_head else None  # each step's keys, for the later steps' chains
    total, hits = 0.0, 0
    for step in range(rollout):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            predicted = head(inputs, embeds, positions, cache, chain_mask(doc, positions, step) if own_lm_head else mask)
            read = head.readout(predicted)
            logits = (head.lm_head(read) if own_lm_head else read.to(vocab_weight.dtype) @ vocab_weight.T).float()
        predicted = predicted.float()
        feature_loss = 0.0 if own_lm_head else F.smooth_l1_loss(predicted, target)
        rooted = positions >= step if own_lm_head else slice(None)  # rows whose chain has a root
        total = total + feature_loss + token_weight * F.cross_entropy(logits[rooted], labels[rooted])
        if step == 0:
            hits = int((logits.argmax(-1) == labels).sum())
        inputs = torch.where(first, true_inputs, predicted.roll(1, dims=0))
    return total / rollout, hits, len(j)


def chain_mask(doc: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
    """(N, N * (step + 1)) bool over the keys of steps 0..step: at rollout step s, row q
    (pair j of its document) is the node at depth s + 1 of the chain rooted at pair j - s.
    It sees its document's true pairs up to j - s (step 0's keys), its chain's node of
    step i at row q - (s - i), and itself."""
    N = len(doc)
    blocks = [(doc[:, None] == doc[None]) & (positions[None] <= positions[:, None] - step)]
    rows = torch.arange(N)
    for i in range(1, step + 1):
        back = step - i
        block = torch.zeros(N, N, dtype=torch.bool)
        ok = positions >= back  # the chain's node lies in the same document
        block[rows[ok], rows[ok] - back] = True
        blocks.append(block)
    return torch.cat(blocks, dim=1)


def train(target, features: Features, lm_weight, config: EagleTrainConfig, work: Path, name: str, sha256,
          log=print, init: eagle.EagleHead | None = None):
    """init: a trained head to start from (more data or more steps on top of it), else a new one."""
    train_idx, held_idx = split(features)
    train_docs = [d for d in documents(features, train_idx) if len(d) > 2]
    held_docs = [d for d in documents(features, held_idx) if len(d) > 2]
    vocab_weight, vocab_index = reduced_vocabulary(features.labels, lm_weight,
                                                   torch.bfloat16 if config.bf16 else torch.float32)
    embed = target.embed

    if config.layout == eagle3.LAYOUT:
        layers = config.feature_layers or default_feature_layers(target.config.num_layers)
        rows = torch.unique(features.labels)
        head = eagle3.new_head(target.config, name, sha256, lm_weight[rows], rows, layers, config.intermediate_size,
                               config.seed)
        eagle3.scale_fc(head, {layer: features.hidden[layer][train_idx[:4096]] for layer in layers})
    else:
        head = eagle.new_head(target.config, name, sha256, config.intermediate_size, config.seed,
                              config.feature_layers)
    if init is not None:
        start_from(head, init)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    shuffled = torch.randperm(len(train_docs), generator=torch.Generator().manual_seed(config.seed)).tolist()
    train_docs = [train_docs[i] for i in shuffled]
    batches = [[train_docs[i] for i in group]
               for group in pack([len(d) for d in train_docs], config.tokens_per_step)]
    held_batches = [[held_docs[i] for i in group] for group in pack([len(d) for d in held_docs], config.tokens_per_step)]
    total = max(1, int(config.epochs * len(batches)))
    started = None if init is None else _fingerprint(init)  # a resume must start from the same head
    checkpoint = Checkpoint(work / "eagle-checkpoint.pt", head, optimizer, config,
                            (len(features), len(held_idx), started))
    step, record = checkpoint.resume()
    if step:
        log(f"resuming from step {step} of {total}")

    def loss_of(docs):
        return packed_loss(head, embed, features, docs, vocab_weight, vocab_index, config.rollout,
                           config.token_weight, config.bf16)

    def evaluate():
        with torch.no_grad():
            totals = [loss_of(docs) for docs in held_batches]
        count = sum(t[2] for t in totals)
        return (round(sum(float(t[0]) * t[2] for t in totals) / max(1, count), 4),
                round(sum(t[1] for t in totals) / max(1, count), 4))

    if "held_out_loss_before" not in record:
        record["held_out_loss_before"], record["held_out_top1_before"] = evaluate()
    started = time.perf_counter()

    @functools.lru_cache(maxsize=1)
    def epoch_order(epoch: int) -> list[int]:  # each epoch its own order, the same on a resume
        return torch.randperm(len(batches), generator=torch.Generator().manual_seed(config.seed + epoch)).tolist()

    def loss_at(step: int) -> torch.Tensor:  # a packed batch of documents per step
        epoch, index = divmod(step, len(batches))
        return loss_of(batches[epoch_order(epoch)[index]])[0]

    run_steps(loss_at, head, optimizer, checkpoint, step, total, config.lr, record, config.checkpoint_every,
              "train eagle")
    head.eval()
    record["held_out_loss_after"], record["held_out_top1_after"] = evaluate()
    record |= {"steps": total, "train_documents": len(train_docs), "held_out_documents": len(held_docs),
               "reduced_vocab": vocab_weight.shape[0], "seconds_this_run": round(time.perf_counter() - started, 1)}
    head.config.training = record
    head.draft_vocab = torch.unique(features.labels)  # the rows its token loss was trained on
    return head, record


def _fingerprint(head) -> str:
    first = next(iter(head.state_dict().values()))
    return hashlib.sha256(first.detach().float().numpy().tobytes()).hexdigest()[:16]


def start_from(head, init) -> None:
    """Copy a trained head's weights into a new one of the same shape (fp32 for training)."""

    mine, theirs = head.state_dict(), init.state_dict()
    if (head.config.layout != init.config.layout
            or {k: v.shape for k, v in mine.items()} != {k: v.shape for k, v in theirs.items()}):
        raise SpecDecodeError("the head to start from has another shape (another target or --intermediate-size)")
    head.load_state_dict({k: v.float() for k, v in theirs.items()})


@torch.no_grad()
def depth_accuracy(head, target, vocab: DraftVocab, features: Features, docs, max_depth: int = 5,
                   top: int = 4) -> list[list[float]]:
    """accuracy[d][r]: P(rank r of the head's candidates at depth d+1 is the target's token |
    the path to it was accepted), the head running on its own predicted features as when
    drafting, reading tokens from `vocab` as it does. Teacher-forced text stands in for
    the accepted path where the text agrees with the target's own predictions (rows
    where it does not drop out at that depth)."""
    final = max(features.hidden)
    layers = head.layers(final)
    dtype = target.dtype
    hits = [[0] * top for _ in range(max_depth)]
    counts = [0] * max_depth
    for doc in docs:
        L = len(doc)
        if L < 3:
            continue
        tokens, labels = features.tokens[doc], features.labels[doc]
        cache = eagle.HeadCache()
        pos = torch.arange(L - 1)
        inputs = head.target_features({l: features.hidden[l][doc[:-1]].to(dtype) for l in layers}, final)
        predicted = head(inputs, target.embed[tokens[1:]], pos, cache)  # f̂ at 1..L-1
        rows = torch.arange(L - 1)  # row i: drafting after position i (the pending token is x_{i+1})
        feature, chain = predicted, []
        if features.drafted is not None and bool(features.drafted[doc[:-1]].any()):
            start = features.drafted[doc[:-1]]  # where decoding drafts: inside the target's answer
            rows, feature = rows[start], feature[start]
        for d in range(max_depth):
            # depth d+1 candidates come from the feature predicted for position i+1+d
            target_pos = rows + 1 + d
            ok = target_pos < L
            rows, feature, target_pos = rows[ok], feature[ok], target_pos[ok]
            chain = [c[ok] for c in chain]
            if rows.numel() == 0:
                break
            ranked = vocab.tokens(vocab.logits(head.readout(feature)).topk(top, dim=-1).indices)
            want = labels[target_pos]
            counts[d] += rows.numel()
            for r in range(top):
                hits[d][r] += int((ranked[:, r] == want).sum())
            # continue where the text is what the target would have said (the accepted path)
            nxt = target_pos + 1
            keep = (nxt < L) & (tokens[nxt.clamp(max=L - 1)] == want)
            rows, feature, want, target_pos = rows[keep], feature[keep], want[keep], target_pos[keep]
            chain = [c[keep] for c in chain]
            if rows.numel() == 0:
                break
            T = rows.numel()
            # the new pair (f̂ at target_pos, x at target_pos+1) attends to the true pairs up to
            # each row's position, to its own earlier predicted pairs, and to itself
            mask = torch.zeros(T, cache.length + T, dtype=torch.bool)
            mask[:, : L - 1] = torch.arange(L - 1)[None] <= rows[:, None]
            for c in chain:
                mask[torch.arange(T), c] = True
            slots = cache.length + torch.arange(T)
            mask[torch.arange(T), slots] = True
            chain.append(slots)
            feature = head(feature, target.embed[want], target_pos, cache, mask)
    return [[round(h / max(1, counts[d]), 4) for h in hits[d]] for d in range(max_depth)]


def choose_shape(accuracy, verify_ratios, draft_depth_ratio: float, max_nodes: int = 10,
                 leaf_ratio: float = 0.0) -> dict:
    """Depth, top-k and number of nodes of the dynamic tree: the static tree of highest
    expected speedup for each depth (a draft costs depth x one head step), best of all.
    Depth 0 (drafting off) when no tree is expected to beat plain decoding."""
    best = {"depth": 0, "top_k": 0, "num_nodes": 0, "expected_speedup": 1.0}
    for depth in range(1, len(accuracy) + 1):
        paths, speedup = choose_tree(accuracy[:depth], verify_ratios, depth * draft_depth_ratio, max_nodes,
                                     leaf_ratio)
        if paths and speedup > best["expected_speedup"]:
            best = {"depth": max(map(len, paths)), "top_k": max(p[-1] for p in paths) + 1,
                    "num_nodes": len(paths), "expected_speedup": round(speedup, 3),
                    "expected_tokens": round(expected_tokens_of_tree(paths, accuracy[:depth]), 3)}
    return best


def run_train_eagle(target_name: str, num_tokens: int = 100_000, num_answers: int = 24, answer_tokens: int = 128,
                    epochs: float = 2.0, out: str | Path | None = None, intermediate_size: int | None = None,
                    log=print, start: str | Path | None = None, feature_layers: Sequence[int] = (),
                    layout: str = eagle3.LAYOUT) -> Path:
    """start: the folder of a trained head to continue from (`--from`), else a new head.
    feature_layers: the target layers a new head fuses; (): EAGLE-3's three for the
    eagle3 layout, the final one for the fused layout."""

    if intermediate_size is not None and intermediate_size <= 0:
        raise SpecDecodeError("--intermediate-size must be positive")
    init = None if start is None else eagle.load(start)  # a wrong folder fails before minutes of set-up
    eagle.check_feature_layers(feature_layers)
    if init is not None:
        if feature_layers and list(feature_layers) != init.config.feature_layers:
            raise SpecDecodeError(f"--feature-layers: the head in {start} reads {init.config.feature_layers or 'the final layer'}")
        feature_layers, layout = tuple(init.config.feature_layers), init.config.layout
    if layout not in ("fused", eagle3.LAYOUT):
        raise SpecDecodeError(f"--layout: fused or {eagle3.LAYOUT}, not {layout!r}")
    layers = tuple(feature_layers) or (default_feature_layers if layout == eagle3.LAYOUT else ())
    target, features, folder, work = prepare(target_name, out, eagle.default_dir, num_tokens, num_answers,
                                             answer_tokens, epochs, "EAGLE", log, layers)
    feature_layers = layers(target.model.config.num_layers) if callable(layers) else layers
    lm_weight = lm_head_weight(target)
    if init is not None:
        if init.config.target_sha256 not in (None, target.info.sha256):
            raise SpecDecodeError(f"the head in {start} was trained for another target ({init.config.target})")
        intermediate_size = intermediate_size or init.config.intermediate_size
        log(f"starting from the head in {start}")
    config = EagleTrainConfig(epochs=epochs, intermediate_size=intermediate_size, feature_layers=tuple(feature_layers),
                              layout=layout)
    head, record = train(target.model, features, lm_weight, config, work, target_name, target.info.sha256, log,
                         init)
    if start is not None:
        record["started_from"] = str(start)
    log(f"held-out loss {record['held_out_loss_before']:.3f} -> {record['held_out_loss_after']:.3f}; "
        f"top-1 {record['held_out_top1_before']:.3f} -> {record['held_out_top1_after']:.3f}")
    head.config.tree = measure_shape(target.model, head, head.vocabulary(target), features, log)
    return eagle.save(folder, head)


def measure_shape(model, head, vocab: DraftVocab, features: Features, log=print) -> dict:
    """Held-out accuracy by depth and rank, this machine's verify and head-step costs, and
    the dynamic tree's depth, top-k and size chosen from them."""
    head = head.to(model.dtype).eval().pack_for_drafting()  # as EagleDrafter runs it
    _, held_idx = split(features)
    held = documents(features, held_idx)
    held = held[::max(1, len(held) // SHAPE_DOCUMENTS)][:SHAPE_DOCUMENTS]  # spread over every kind of text
    accuracy = depth_accuracy(head, model, vocab, features, held)
    return shape_for(model, head, vocab, accuracy, log)


def shape_for(model, head, vocab: DraftVocab, accuracy, log=print) -> dict:
    """The dynamic tree's depth, top-k and size for held-out `accuracy` [depth][rank], from
    this machine's verify curve, per-path attention cost and head step (over `vocab`)."""

    head = head.to(model.dtype).eval().pack_for_drafting()  # as EagleDrafter runs it
    max_nodes = max_tree_nodes(model)
    verify = measure_verify_curve(model, sizes=tuple(range(1, max_nodes + 2)), repeats=3)
    leaf_ratio = measure_leaf_cost(model) / verify[1]
    costs = cost_model(verify, _time_head_step(model, head, vocab))
    shape = choose_shape(accuracy, costs.verify_ratios, costs.draft_ratio, max_nodes, leaf_ratio)
    log(f"accuracy by depth (top-1) {[a[0] for a in accuracy]}; tree: depth {shape['depth']}, "
        f"top-{shape['top_k']}, {shape['num_nodes']} nodes, expected {shape['expected_speedup']:.2f}x")
    return shape | {"accuracy": accuracy, "head_step_ratio": round(costs.draft_ratio, 4),
                    "fitted_on": machine.fit_record(model)}


def _time_head_step(model, head, vocab: DraftVocab, rows: int = 3, repeats: int = 5) -> float:
    """Seconds of one drafting depth: a head pass over a few nodes and their LM-head rows."""
    H = head.config.hidden_size
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            cache = eagle.HeadCache()
            head(torch.randn(64, H).to(model.dtype), torch.randn(64, H).to(model.dtype), torch.arange(64), cache)
            started = time.perf_counter()
            out = head(torch.randn(rows, H).to(model.dtype), torch.randn(rows, H).to(model.dtype),
                       torch.full((rows,), 64), cache, torch.ones(rows, 64 + rows, dtype=torch.bool))
            vocab.logits(head.readout(out)).topk(4, dim=-1)
            times.append(time.perf_counter() - started)
    return sorted(times[1:])[repeats // 2]
