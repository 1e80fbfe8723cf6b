"""What the local model cache holds: every model with its disk use, and removal of one.

The cache's layout and how folders get there are store.py's; this module only reads it
(and deletes a whole folder on request)."""

import shutil
from pathlib import Path

from specdecode.errors import ModelError
from specdecode.models.convert import WEIGHT_FILES
from specdecode.models.registry import REGISTRY
from specdecode.models.store import cached, home, model_dir, read_manifest


def remove(name: str) -> Path:
    """Delete cached model `name` (a registry name or a `gguf-...` folder); returns its path."""
    root = home() / "models"
    folder = root / name
    if not name or Path(name).name != name or name in (".", "..") or not folder.is_dir():
        cached = ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir())) if root.is_dir() else ""
        raise ModelError(f"no cached model {name!r} in {root}" + (f"; cached: {cached}" if cached else ""))
    shutil.rmtree(folder)
    return folder


def disk_usage(folder: str | Path) -> dict[str, int]:
    """Bytes a model folder takes, by kind: gguf, bf16, fp32, other, and total.

    Symlinks count nothing (the bf16 stand-in for model.safetensors), `.partial` files
    count as other."""
    folder = Path(folder)
    manifest = read_manifest(folder) or {}
    kinds = {WEIGHT_FILES["bf16"]: "bf16", WEIGHT_FILES["fp32"]: "fp32"}
    if manifest.get("gguf"):
        kinds[manifest["gguf"]] = "gguf"
    usage = {"gguf": 0, "bf16": 0, "fp32": 0, "other": 0}
    for entry in folder.rglob("*") if folder.is_dir() else []:
        if entry.is_symlink() or not entry.is_file():
            continue
        kind = kinds.get(entry.name) if entry.parent == folder else None
        usage[kind or ("gguf" if entry.suffix == ".gguf" else "other")] += entry.stat().st_size
    usage["total"] = sum(usage.values())
    return usage


def list_models() -> list[dict]:
    """Every registry model, then every other cached folder (a converted local .gguf):
    name, description, bytes (download), cached, path (if cached), disk (by kind, if cached)."""
    rows = []
    for spec in REGISTRY.values():
        folder = model_dir(spec.name)
        is_cached = cached(folder, spec.sha256)
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "bytes": spec.size,
                "cached": is_cached,
                "path": str(folder) if is_cached else None,
                "disk": disk_usage(folder) if is_cached else None,
            }
        )
    root = home() / "models"
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        manifest = read_manifest(folder)
        if folder.name in REGISTRY or manifest is None:
            continue
        rows.append(
            {
                "name": folder.name,
                "description": f"converted from {manifest.get('source_file')}",
                "bytes": manifest.get("bytes") or 0,
                "cached": True,
                "path": str(folder),
                "disk": disk_usage(folder),
            }
        )
    return rows
