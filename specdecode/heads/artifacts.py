"""Where a head (Medusa, EAGLE) for a target is found: trained or re-shaped here, beside
the target's cached weights, first; else shipped with the package (specdecode/artifacts).

A tree is fitted to the costs of the target's weights (policy/machine.py), so a copy
re-shaped for quantized weights lives apart from the bf16 one (`medusa-gguf` beside
`medusa`): switching `--dtype` back and forth finds each fitted once. That copy holds the
same heads as the artifact it was re-shaped from, and is passed over once they differ (heads
trained again, or a newer package's)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.errors import SpecDecodeError

SHIPPED = Path(__file__).resolve().parent.parent / "artifacts"


FLOAT_WEIGHTS = "bfloat16"  # the weights heads are trained on; their artifacts' folder has no suffix


def local_dir(kind: str, target_folder: str | Path, weights: str = FLOAT_WEIGHTS) -> Path:
    """Where a `kind` artifact (medusa | eagle) for a target with these weights is written
    here: $SPECDECODE_HOME/models/NAME/medusa, or medusa-gguf (-q8_0, ...) for others."""
    return Path(target_folder) / (kind if weights == FLOAT_WEIGHTS else f"{kind}-{weights}")


def find_artifact(kind: str, config_file: str, target_name: str, target_folder: str | Path, what: str,
                  flag: str, weights: str = FLOAT_WEIGHTS) -> Path:
    """A drafter artifact (`kind` = medusa | eagle) for a target with `weights`: re-shaped
    here for those weights, else trained or re-shaped here (beside the target's cached
    weights), else shipped with the package. A re-shaped copy of a shipped artifact that
    has since been replaced (a newer package) is passed over for the new one, which is
    then fitted again in its place."""
    shipped, local = SHIPPED / target_name / kind, local_dir(kind, target_folder)
    if (local / config_file).is_file() and not _refit_of_replaced(local / config_file, shipped / config_file):
        found = local
    elif (shipped / config_file).is_file():
        found = shipped
    else:
        raise SpecDecodeError(f"no {what} for {target_name}: run `specdecode train {kind} --target {target_name}` "
                              f"or pass {flag} PATH")
    refitted = local_dir(kind, target_folder, weights)
    if (refitted != local and (refitted / config_file).is_file()
            and not _refit_of_replaced(refitted / config_file, shipped / config_file)
            and heads_hash(refitted) == heads_hash(found)):
        return refitted  # the same heads, their tree fitted to these weights
    return found


REFIT_KEY = "refitted_from_shipped"  # in a re-shaped artifact's record: the shipped weights' hash


def shipped_hash(folder: Path) -> str | None:
    """The hash of the weights in `folder` when it is a shipped artifact, else None."""
    folder = Path(folder).resolve()
    if SHIPPED.resolve() not in folder.parents:
        return None
    weights = next(folder.glob("*.safetensors"), None)
    return None if weights is None else hashlib.sha256(weights.read_bytes()).hexdigest()[:16]


def heads_hash(folder: Path) -> str | None:
    """A hash of the tensors of a head artifact in `folder`, names and values (None: it has
    no weights file): equal for two copies of the same heads however each file was written."""
    weights = next(Path(folder).glob("*.safetensors"), None)
    if weights is None:
        return None
    stat = weights.stat()
    return _tensors_hash(str(weights.resolve()), stat.st_size, stat.st_mtime_ns)


# Asked on every drafter built on quantized weights (each `generate`): a file is read and
# hashed again only once it changes (tens of milliseconds for the shipped heads).
@functools.lru_cache(maxsize=16)
def _tensors_hash(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(path).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _refit_of_replaced(config_path: Path, shipped_config: Path) -> bool:
    record = json.loads(config_path.read_text())
    source = next((part[REFIT_KEY] for part in record.values() if isinstance(part, dict) and REFIT_KEY in part), None)
    return source is not None and shipped_config.is_file() and source != shipped_hash(shipped_config.parent)


def write_folder(folder: str | Path, weights_file: str, tensors: dict[str, torch.Tensor], config_file: str,
                 config: dict, indent: int = 1) -> Path:
    """A head's weights and config into `folder`, each landing by rename: a reader never
    sees a half-written file (the weights land first, so a config always has its weights)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / (weights_file + ".partial"), metadata={"format": "pt"})
    (folder / (config_file + ".partial")).write_text(json.dumps(config, indent=indent) + "\n")
    (folder / (weights_file + ".partial")).replace(folder / weights_file)
    (folder / (config_file + ".partial")).replace(folder / config_file)
    return folder
