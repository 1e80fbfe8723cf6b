"""A GGUF file's weights as the kernel reads them, kept on disk so that later loads skip the work.

Reading a GGUF with the `gguf` package parses every metadata field (a Qwen file's
tokenizer is 150,000 strings), and the kernel reads most matrices repacked eight rows at a
time (quant.kernel_layout); of a warm load of Qwen2.5-1.5B's Q4_K_M file that was about
20 s. The first load keeps what they produce: each repacked matrix, the vectors, and where
each matrix's own blocks lie in the GGUF. Later loads map that copy and the GGUF's blocks
(torch's and numpy's memory maps) and parse nothing; their weights are the same bytes.

The copy lives in the model's cache folder, or under home()/prepared/ for a folder of the
user's, named for the GGUF's path. Its tag hashes the code that makes it (this file,
quant.py, gguf_weights.py) and the GGUF's size and modification time: a change to any
makes a new copy, and older ones of the same file are removed. It is written whole and
renamed into place, so deleting it is always safe (the next load makes it again).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdecode.models.config import ModelConfig
from specdecode.models.gguf_weights import read_gguf, requantized_note
from specdecode.models.quant import QuantTensor, kernel_layout
from specdecode.models.store import home, read_manifest, sweep_partials

log = logging.getLogger("specdecode")

FORMAT = 1  # of the saved dictionary (_save)
SUFFIX = ".prepared.pt"
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def load_prepared(gguf: str | Path, config: ModelConfig, folder: str | Path) -> dict[str, torch.Tensor | QuantTensor]:
    """The GGUF's weights as gguf_weights.load_gguf_weights gives them, each repacked
    matrix's `layout` made: from the prepared copy where one is current, else from the file
    (then kept, where the disk allows)."""
    gguf = Path(gguf)
    path = prepared_path(gguf, Path(folder))
    if path.is_file():
        try:
            return _read(path, gguf)
        except Exception as err:  # a damaged or unreadable copy is made again
            log.warning("%s: unreadable (%s); preparing it again", path, err)
            with contextlib.suppress(OSError):  # a folder that refuses it: replaced below, or not kept
                path.unlink(missing_ok=True)
    found = read_gguf(gguf, config)
    _make_layouts(found.tensors)
    try:
        _save(path, found.tensors, found.offsets, found.requantized)
    except OSError as err:
        log.warning("could not keep the prepared weights at %s (%s); the next load prepares them again", path, err)
        return found.tensors
    del found  # read back mapped, as every later load is: the copies made here are freed first
    return _read(path, gguf)


def _make_layouts(weights: dict) -> None:
    """Each matrix's kernel layout where it is not the blocks as stored; the embedding's only
    where it is also the head (a tied model without an output matrix)."""
    for name, tensor in weights.items():
        if isinstance(tensor, QuantTensor) and (name != EMBEDDING or HEAD not in weights):
            layout = kernel_layout(tensor)
            tensor.layout = None if layout is tensor.data else layout


def prepared_path(gguf: Path, folder: Path) -> Path:
    """Where the prepared copy of `gguf` run from `folder` is (whether or not it is there)."""
    where = folder if read_manifest(folder) is not None else home() / "prepared"
    return where / f"{_file_key(gguf)}.{_tag(gguf)}{SUFFIX}"


def _file_key(gguf: Path) -> str:
    return f"{gguf.stem}-{hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]}"


def _tag(gguf: Path) -> str:
    digest = hashlib.sha256(f"{FORMAT}".encode())
    for module in ("prepared.py", "quant.py", "gguf_weights.py"):
        digest.update((Path(__file__).parent / module).read_bytes())
    stat = gguf.stat()
    digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def _save(path: Path, weights: dict, offsets: dict[str, int], requantized: tuple[str, ...]) -> None:
    """The copy written as a `.partial` and renamed over `path`; older copies of the file removed."""
    payload = {"format": FORMAT, "requantized": list(requantized), "vectors": {}, "matrices": {}}
    for name, tensor in weights.items():
        if not isinstance(tensor, QuantTensor):
            payload["vectors"][name] = tensor
            continue
        entry = {"qtype": int(tensor.qtype), "rows": tensor.data.shape[0]}
        if name in offsets:  # the file's own bytes: mapped from the GGUF, not copied
            entry["offset"], entry["bytes"] = offsets[name], tensor.nbytes
        else:
            entry["blocks"] = tensor.data
        if tensor.layout is not None:
            entry["layout"] = tensor.layout
        payload["matrices"][name] = entry
    save_whole(payload, path, SUFFIX)


def save_whole(payload: dict, path: Path, suffix: str) -> None:
    """torch.save as a `.partial` renamed over `path` (never a half-written file), then the
    files kept for the same file key under other tags removed. A write that fails raises
    OSError, whichever layer refused it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(path.parent)  # a load interrupted while it kept a copy leaves one (a gigabyte for a 1.5B model)
    partial = path.with_name(f".{path.name}.pid{os.getpid()}.partial")
    try:
        try:
            torch.save(payload, partial)
        except RuntimeError as err:  # torch writes in C++: a full disk or a refused file comes back as this
            raise OSError(f"could not write {partial}: {err}") from err
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    remove_older(path, suffix)


def split_name(path: Path, suffix: str) -> tuple[str, str]:
    """(file key, tag) of a kept file named `<key>.<tag><suffix>`; a key may hold dots ("qwen2.5-...")."""
    key, _, tag = path.name.removesuffix(suffix).rpartition(".")
    return key, tag


def remove_older(path: Path, suffix: str) -> None:
    """Remove the files beside `path` kept for the same file key under other tags."""
    key, _ = split_name(path, suffix)
    for older in path.parent.glob(f"{glob.escape(key)}.*{suffix}"):
        if older != path and split_name(older, suffix)[0] == key:
            older.unlink(missing_ok=True)


def _read(path: Path, gguf: Path) -> dict[str, torch.Tensor | QuantTensor]:
    payload = torch.load(path, mmap=True, weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"format {payload.get('format')}, not {FORMAT}")
    blocks = np.memmap(gguf, dtype=np.uint8, mode="c")  # copy-on-write: writable views, the file untouched
    weights: dict[str, torch.Tensor | QuantTensor] = dict(payload["vectors"])
    for name, entry in payload["matrices"].items():
        qtype = GGMLQuantizationType(entry["qtype"])
        if "blocks" in entry:
            data = entry["blocks"]
        else:
            start = entry["offset"]
            data = torch.from_numpy(blocks[start:start + entry["bytes"]]).view(entry["rows"], -1, GGML_QUANT_SIZES[qtype][1])
        weights[name] = QuantTensor(qtype, data, entry.get("layout"))
    requantized_note(gguf, tuple(payload["requantized"]))
    return weights
