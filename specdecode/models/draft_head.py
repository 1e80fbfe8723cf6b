"""A model loaded to draft reads its LM head at five bits.

A draft model only proposes: the target checks every token, so how the draft rounds
changes how often it is right, never what is output. Its LM head is a large part of what
a draft step streams: in Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file, a Q8_0 head of 145 MB
out of 394 MB. Requantized to Q5_0 (94 MB), its top tokens hardly change: drafting for
Qwen2.5-Coder-1.5B-Instruct on 16 prompts of four kinds (96 new tokens each, k = 2), its
acceptance was the same on translation, math and code completion and 0.640 against 0.634
on chat, while its one-token step fell from 14.1 to 12.5 ms (AMD EPYC Zen 4, 2 threads).
Q4_0 lost 3 points of acceptance and was no faster (its blocks run as stored, not
repacked), so five bits it is.

Only heads stored wider than that are requantized: Q8_0, which is also what float heads
become under `--dtype q8_0`. Narrower types (Q6_K, Q5_0, Q4_K, ...) stay as stored. A
GGUF's requantized head is kept beside its prepared copy (prepared.py), so only the first
load pays the few seconds it takes; like that copy it is written whole and renamed into
place, and made again when unreadable.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdecode.models.prepared import EMBEDDING, HEAD, SUFFIX, prepared_path, save_whole, split_name
from specdecode.models.quant import QuantTensor, kernel_layout

log = logging.getLogger("specdecode")

WIDER_THAN_DRAFT = (GGMLQuantizationType.Q8_0,)  # head types a draft reads requantized
DRAFT_HEAD_TYPE = GGMLQuantizationType.Q5_0
DRAFT_HEAD_SUFFIX = ".draft-head.pt"


def draft_head_path(gguf: Path, folder: Path) -> Path:
    """Where the draft head of `gguf` run from `folder` is kept: beside its prepared copy,
    tagged by that copy's tag and this file (a change to either makes a new one)."""
    prepared = prepared_path(gguf, folder)
    key, tag = split_name(prepared, SUFFIX)
    digest = hashlib.sha256(tag.encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    return prepared.with_name(f"{key}.{digest}{DRAFT_HEAD_SUFFIX}")


def with_draft_head(weights: dict, keep: Path | None = None) -> dict:
    """The weights with their LM head requantized for drafting, where it is stored wider
    than DRAFT_HEAD_TYPE; otherwise the weights as given. keep: a file to read the
    requantized head from, or to write it to (None: made in memory each time)."""
    head = weights.get(HEAD, weights.get(EMBEDDING))  # a tied model's head is its embedding
    values_per_block, _ = GGML_QUANT_SIZES[DRAFT_HEAD_TYPE]
    if (not isinstance(head, QuantTensor) or head.qtype not in WIDER_THAN_DRAFT
            or head.shape[1] % values_per_block):
        return weights
    slim = _read(keep) if keep is not None and keep.is_file() else None
    if slim is None:
        slim = QuantTensor.quantize(head.dequantize(), DRAFT_HEAD_TYPE)
        slim.layout = kernel_layout(slim)
        if keep is not None:
            _save(keep, slim)
    return {**weights, HEAD: slim}


def _read(path: Path) -> QuantTensor | None:
    try:
        saved = torch.load(path, mmap=True, weights_only=True)
        return QuantTensor(GGMLQuantizationType(saved["qtype"]), saved["blocks"], saved["layout"])
    except Exception as err:  # damaged or unreadable: made again
        log.warning("%s: unreadable (%s); requantizing the draft head again", path, err)
        with contextlib.suppress(OSError):  # a folder that refuses it: the head is made in memory
            path.unlink(missing_ok=True)
        return None


def _save(path: Path, head: QuantTensor) -> None:
    """Kept as prepared.py keeps its copy; a disk that refuses it costs only the next load's
    requantization."""
    try:
        save_whole({"qtype": int(head.qtype), "blocks": head.data, "layout": head.layout}, path, DRAFT_HEAD_SUFFIX)
    except OSError as err:
        log.warning("could not keep the draft head at %s (%s)", path, err)
