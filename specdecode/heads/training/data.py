"""The training set of a drafter head: documents -> target features, cached for resumes."""

from __future__ import annotations

import hashlib
import json
from typing import Callable
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from specdecode.core.prompts import encode_prompt
from specdecode.errors import SpecDecodeError
from specdecode.heads.training.batch_greedy import answer_features as batch_features
from specdecode.models.load import load_model
from specdecode.heads.training.corpus import stdlib_chunks
from specdecode.heads.training.features import Features, collect, concat
from specdecode.heads.training.instructions import instructions

CHUNK = 512  # tokens per teacher-forced pass
CORPUS_VERSION = 2  # bump when the training text changes, so cached features are not reused
ANSWER_BATCH = 64  # prompts answered together: a step reads the weights once for all of them
ANSWER_BLOCK = 2240  # prompts sorted by length together: README's Qwen commands answer one block
MAX_PROMPT_TOKENS = 384
FEATURES_DIR = "training-features"  # beside the target's cached weights, shared by every head


def answer_features(target, num_answers: int, answer_tokens: int, work: Path, batch_size: int = ANSWER_BATCH,
                    block: int = ANSWER_BLOCK, log=print, layers: tuple[int, ...] = ()) -> Features:
    """The target's greedy answers to the first num_answers training instructions, with
    its features along them (batch_greedy.py): the final layer's and those of `layers`.

    Prompts are sorted by length within blocks of `block`, so that a batch pads little.
    Each finished batch is saved under a name made from its prompts, so an interrupted run
    resumes, and a later run reads every batch an earlier one answered: asking for more
    answers answers only the new blocks."""

    encoded = ((encode_prompt(target.tokenizer, text), source) for text, source in instructions())
    pairs = list(islice(((ids, source) for ids, source in encoded if len(ids) <= MAX_PROMPT_TOKENS), num_answers))
    prompts, sources = [ids for ids, _ in pairs], [source for _, source in pairs]
    if len(prompts) < num_answers:
        log(f"only {len(prompts)} training instructions fit; answering those")
    order = [i for start in range(0, len(prompts), block)
             for i in sorted(range(start, min(start + block, len(prompts))), key=lambda i: len(prompts[i]))]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    inner = tuple(sorted(set(layers) - {target.model.config.num_layers}))
    # the final layer alone keeps the key it always had, so answers cached before are found
    folder = work / f"answers-{_key(target, answer_tokens, *([list(inner)] if inner else []))}"
    folder.mkdir(parents=True, exist_ok=True)
    eos = frozenset(target.info.eos_token_ids)
    parts = []
    with tqdm(total=len(prompts), desc="target answers", unit="prompt") as bar:
        for batch in batches:
            batch_prompts = [prompts[i] for i in batch]
            path = folder / f"batch-{_key(batch_prompts)}.safetensors"
            if path.is_file():
                part = Features.load(path)
            else:
                part = batch_features(target.model, batch_prompts, answer_tokens, eos, layers=inner)  # doc id = row
                part.save(path)
            # concat() numbers each part's documents from its first present one (an empty
            # answer leaves no document), so the sources go from there alike
            first, last = int(part.doc_ids.min()), int(part.doc_ids.max())
            part.sources = [sources[batch[row]] for row in range(first, last + 1)]
            parts.append(part)
            bar.update(len(batch))
    return concat(parts)


def _key(*settings) -> str:
    """A short hash of settings; a target stands for its weights' hash."""
    settings = [s.info.sha256 if hasattr(s, "info") else s for s in settings]
    return hashlib.sha256(json.dumps([CORPUS_VERSION, *settings]).encode()).hexdigest()[:12]


def training_features(target, layers: tuple[int, ...], num_tokens: int, num_answers: int, answer_tokens: int,
                      work: Path, log=print) -> Features:
    """Features of the target's answers and of standard-library source (num_tokens of it);
    each computed once per setting and kept in the work folder, for `layers` (which
    include the final one)."""
    work.mkdir(parents=True, exist_ok=True)
    parts = [answer_features(target, num_answers, answer_tokens, work, log=log, layers=layers)] if num_answers else []
    path = work / f"stdlib-{_key(target, layers, num_tokens, CHUNK)}.safetensors"
    chunks = stdlib_chunks(target.tokenizer, num_tokens, CHUNK) if num_tokens else []
    if chunks:
        if path.is_file():
            log(f"reusing the target's features of standard-library source from {path}")
            stdlib = Features.load(path)
        else:
            documents = [ids for ids, _ in chunks]
            with tqdm(total=sum(map(len, documents)), desc="target features", unit="tok") as bar:
                stdlib = collect(target.model, documents, layers, progress=bar.update)
            stdlib.save(path)
        stdlib.sources = [source for _, source in chunks]
        parts.append(stdlib)
    return concat(parts)


def prepare(target_name: str, out, default_dir, num_tokens: int, num_answers: int, answer_tokens: int,
            epochs: float, what: str, log=print,
            feature_layers: tuple[int, ...] | Callable[[int], tuple[int, ...]] = ()):
    """What every `specdecode train` does first: check the settings, load the target, make
    the work folder beside the artifact, and get the target's features (cached and shared).
    The artifact folder is `out`, else default_dir(the target's cached folder). Returns
    (target, features, artifact folder, work folder). The features hold the final layer
    and `feature_layers` (or, callable, the layers it names for the target's count)."""

    if num_tokens < 0 or num_answers < 0 or epochs <= 0:
        raise SpecDecodeError("--tokens, --answers and --epochs must be positive")
    if num_tokens == 0 and num_answers == 0:
        raise SpecDecodeError("no training text: give --tokens or --answers a positive number")
    target = load_model(target_name)
    if not hasattr(target.model, "lm_head_weight"):
        raise SpecDecodeError(f"{what} needs the native backend (a Llama-family target)")
    folder = Path(out) if out else default_dir(target.info.folder)
    if callable(feature_layers):
        feature_layers = feature_layers(target.model.config.num_layers)
    if any(not 0 < layer <= target.model.config.num_layers for layer in feature_layers):
        raise SpecDecodeError(f"{target_name} has layers 1 to {target.model.config.num_layers}, "
                              f"not {sorted(feature_layers)}")
    work = folder.with_name(folder.name + ".work")  # the checkpoint, for resuming
    work.mkdir(parents=True, exist_ok=True)
    layers = tuple(sorted(set(feature_layers) | {target.model.config.num_layers}))
    features = training_features(target, layers, num_tokens, num_answers,
                                 answer_tokens, Path(target.info.folder) / FEATURES_DIR, log)
    log(f"{len(features)} positions of target features")
    return target, features, folder, work
