"""`train --reshape-only`: the shipped SmolLM2 heads get a tree chosen on this machine,
the weights untouched, written where asked."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode.heads import artifacts
from specdecode.heads.eagle import model as eagle
from specdecode.heads.medusa import model as medusa
from specdecode.heads.refit import reshape_eagle, reshape_medusa

SHIPPED = artifacts.SHIPPED / "smollm2-135m-instruct"


def fits(caplog) -> int:
    """How many refits were announced since the last call (the log goes to stderr in the CLI)."""
    count = sum("fitting the" in message for message in caplog.messages)
    caplog.clear()
    return count


@pytest.mark.real
def test_reshape_medusa_keeps_the_heads_and_writes_a_tree_for_this_machine(tmp_path):
    folder = reshape_medusa("smollm2-135m-instruct", SHIPPED / "medusa", tmp_path / "medusa", log=lambda _: None)
    _, config = medusa.load(folder)
    _, shipped = medusa.load(SHIPPED / "medusa")
    assert config.accuracy == shipped.accuracy and "expected_speedup" in config.training
    assert all(len(p) <= config.num_heads for p in config.tree)  # a tree the heads can draft (or none: off)
    for name, tensor in load_file(folder / medusa.WEIGHTS_FILE).items():
        assert torch.equal(tensor, load_file(SHIPPED / "medusa" / medusa.WEIGHTS_FILE)[name]), name


@pytest.mark.real
def test_reshape_for_quantized_weights_records_them(tmp_path):
    from specdecode.commands.cli import main

    assert main(["train", "medusa", "--reshape-only", "--target", "smollm2-135m-instruct", "--dtype", "gguf",
                 "--from", str(SHIPPED / "medusa"), "--out", str(tmp_path / "medusa-gguf")]) == 0
    _, config = medusa.load(tmp_path / "medusa-gguf")
    assert config.training["fitted_on"]["weights"] == "gguf"
    # training itself runs on the bf16 target: one line and status 2, nothing trained
    assert main(["train", "medusa", "--target", "smollm2-135m-instruct", "--dtype", "gguf"]) == 2


@pytest.mark.real
def test_reshape_eagle_keeps_the_head_and_its_accuracy(tmp_path):
    folder = reshape_eagle("smollm2-135m-instruct", SHIPPED / "eagle", tmp_path / "eagle", log=lambda _: None)
    tree = json.loads((folder / eagle.CONFIG_FILE).read_text())["tree"]
    shipped = json.loads((SHIPPED / "eagle" / eagle.CONFIG_FILE).read_text())["tree"]
    assert tree["accuracy"] == shipped["accuracy"]
    assert {"depth", "top_k", "num_nodes", "expected_speedup"} <= set(tree) and tree["expected_speedup"] >= 1.0
    for name, tensor in load_file(folder / eagle.WEIGHTS_FILE).items():
        assert torch.equal(tensor, load_file(SHIPPED / "eagle" / eagle.WEIGHTS_FILE)[name]), name


def test_fitted_elsewhere_compares_only_what_the_artifact_records(monkeypatch):
    from specdecode.policy import machine

    monkeypatch.setattr(machine, "fingerprint", lambda: {"cpu": "AMD EPYC", "kernel": "avx2", "threads": 2})
    assert machine.fitted_elsewhere({"kernel": "amx", "threads": 2})
    assert machine.fitted_elsewhere({"cpu": "Intel Xeon", "kernel": "avx2", "threads": 2})
    assert not machine.fitted_elsewhere({"kernel": "avx2", "threads": 2})
    assert not machine.fitted_elsewhere(None)  # an artifact that does not say is taken as it is
    assert not machine.fitted_elsewhere({})


def test_fitted_elsewhere_tells_the_target_weights_apart(monkeypatch):
    """A tree fitted to bf16 costs is not the quantized target's: there a pass over many
    tokens costs far more, and the bf16 tree ran it at half its plain rate."""
    from specdecode.policy import machine

    monkeypatch.setattr(machine, "fingerprint", lambda: {"cpu": "AMD EPYC", "kernel": "avx512", "threads": 2})
    bf16 = {"cpu": "AMD EPYC", "kernel": "avx512", "threads": 2, "weights": "bfloat16"}
    assert not machine.fitted_elsewhere(bf16, "bfloat16")
    assert machine.fitted_elsewhere(bf16, "gguf")
    assert machine.fitted_elsewhere(bf16 | {"weights": "gguf"}, "bfloat16")
    unknown = {key: value for key, value in bf16.items() if key != "weights"}  # fitted before weights were recorded
    assert machine.fitted_elsewhere(unknown, "bfloat16") and machine.fitted_elsewhere(unknown, "gguf")
    assert not machine.fitted_elsewhere(unknown)  # asked about the machine alone


def test_a_shape_fitted_before_the_kernels_changed_counts_as_fitted_elsewhere():
    from specdecode.policy import machine

    here = machine.fingerprint()
    assert here["kernel_sources"] != "none" or here["kernel"] == "none"
    assert not machine.fitted_elsewhere(here)
    assert machine.fitted_elsewhere(here | {"kernel_sources": "an older build"})
    if here["kernel"] != "none":  # one that records its kernel but not their version: fitted by older ones
        assert machine.fitted_elsewhere({key: value for key, value in here.items() if key != "kernel_sources"})


def test_the_shipped_qwen_medusa_tree_records_the_kernels_it_ships_with():
    """A kernel change must come with the shipped tree fitted again (`train medusa
    --reshape-only`), or every machine like the one it was fitted on refits it on first use."""
    from specdecode.models import kernels

    record = json.loads((artifacts.SHIPPED / "qwen2.5-coder-1.5b-instruct" / "medusa" / medusa.CONFIG_FILE)
                        .read_text())["training"]["fitted_on"]
    assert record["kernel_sources"] == kernels.source_tag(record["kernel"])
    assert record["weights"] == "bfloat16"  # a quantized target gets a tree of its own (medusa-gguf)


@pytest.mark.real
def test_bf16_and_quantized_targets_each_get_a_tree_fitted_once(tmp_path, monkeypatch, caplog):
    """Switching --dtype between bf16 and gguf fits each its own tree, in its own folder
    beside the target, once: neither overwrites the other."""
    import dataclasses

    from specdecode.policy import machine
    from specdecode.api import Model, load_model
    from specdecode.heads.loading import medusa_drafter

    monkeypatch.setattr(machine, "fingerprint", lambda: {"cpu": "a test CPU", "kernel": "avx2", "threads": 2})
    targets = {}
    for dtype in ("bf16", "gguf"):
        loaded = load_model("smollm2-135m-instruct", dtype=dtype)
        for weights in Path(loaded.info.folder).glob("*.safetensors"):  # a quantized target's heads read its float head
            if not (tmp_path / weights.name).exists():
                (tmp_path / weights.name).symlink_to(weights)
        targets[dtype] = Model(loaded.model, loaded.tokenizer, dataclasses.replace(loaded.info, folder=tmp_path))
    for dtype, folder in (("bf16", "medusa"), ("gguf", "medusa-gguf")):
        medusa_drafter(targets[dtype])
        assert fits(caplog) == 1
        record = json.loads((tmp_path / folder / medusa.CONFIG_FILE).read_text())["training"]["fitted_on"]
        assert record["weights"] == ("bfloat16" if dtype == "bf16" else "gguf")
    for dtype in ("bf16", "gguf", "bf16"):
        medusa_drafter(targets[dtype])
        assert fits(caplog) == 0
    assert medusa.find("smollm2-135m-instruct", tmp_path, "gguf") == tmp_path / "medusa-gguf"
    assert medusa.find("smollm2-135m-instruct", tmp_path) == tmp_path / "medusa"

    weights = tmp_path / "medusa" / medusa.WEIGHTS_FILE  # heads trained again here: the gguf copy is stale
    tensors = load_file(weights)
    name = next(iter(tensors))
    save_file(tensors | {name: tensors[name] + 1}, weights)
    assert medusa.find("smollm2-135m-instruct", tmp_path, "gguf") == tmp_path / "medusa"
    medusa_drafter(targets["gguf"])
    assert fits(caplog) == 1
    assert medusa.find("smollm2-135m-instruct", tmp_path, "gguf") == tmp_path / "medusa-gguf"


@pytest.mark.real
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_shipped_tree_fitted_on_another_machine_is_fitted_here_once(kind, tmp_path, monkeypatch, caplog):
    """The shipped SmolLM2 trees record the CPU they were fitted on (an Intel Xeon with AMX); elsewhere the
    first use fits them again into the target's folder, and later uses find that one."""
    import dataclasses

    from specdecode.policy import machine
    from specdecode.api import Model, load_model
    from specdecode.heads.loading import eagle_drafter, medusa_drafter

    here = {"cpu": "a test CPU", "kernel": "avx2", "threads": 2}
    monkeypatch.setattr(machine, "fingerprint", lambda: here)
    loaded = load_model("smollm2-135m-instruct")
    target = Model(loaded.model, loaded.tokenizer, dataclasses.replace(loaded.info, folder=tmp_path))
    make = eagle_drafter if kind == "eagle" else medusa_drafter
    shipped = json.loads((SHIPPED / kind / f"{kind}.json").read_text())
    assert machine.fitted_elsewhere((shipped["tree"] if kind == "eagle" else shipped["training"])["fitted_on"])

    make(target)
    assert fits(caplog) == 1
    refitted = json.loads((tmp_path / kind / f"{kind}.json").read_text())
    assert (refitted["tree"] if kind == "eagle" else refitted["training"])["fitted_on"] == here | {"weights": "bfloat16"}
    make(target)  # found beside the target now, fitted here: not again
    assert fits(caplog) == 0


@pytest.mark.real
def test_a_head_named_by_path_is_not_rewritten_but_warned_of(monkeypatch, caplog):
    from specdecode.policy import machine
    from specdecode.api import load_model
    from specdecode.heads.loading import eagle_drafter

    monkeypatch.setattr(machine, "fingerprint", lambda: {"cpu": "a test CPU", "kernel": "avx2", "threads": 2})
    with pytest.warns(UserWarning, match="fitted on another machine.*--reshape-only --from"):
        drafter = eagle_drafter(load_model("smollm2-135m-instruct"), str(SHIPPED / "eagle"))
    assert fits(caplog) == 0
    shipped = json.loads((SHIPPED / "eagle" / eagle.CONFIG_FILE).read_text())["tree"]
    assert drafter.depth == shipped["depth"]  # the shipped shape, as it is


@pytest.mark.real
def test_a_refit_of_a_shipped_head_since_replaced_gives_way_to_the_new_one(tmp_path, monkeypatch, caplog):
    """A newer package ships another head: the copy fitted here from the old one is passed
    over for it, and the new one is fitted in its place; a head trained here is kept."""
    import dataclasses

    from specdecode.policy import machine
    from specdecode.api import Model, load_model
    from specdecode.heads.loading import eagle_drafter

    monkeypatch.setattr(machine, "fingerprint", lambda: {"cpu": "a test CPU", "kernel": "avx2", "threads": 2})
    loaded = load_model("smollm2-135m-instruct")
    target = Model(loaded.model, loaded.tokenizer, dataclasses.replace(loaded.info, folder=tmp_path))
    eagle_drafter(target)
    assert fits(caplog) == 1
    record = json.loads((tmp_path / "eagle" / eagle.CONFIG_FILE).read_text())["tree"]
    assert record[artifacts.REFIT_KEY] == artifacts.shipped_hash(SHIPPED / "eagle")
    assert eagle.find("smollm2-135m-instruct", tmp_path) == tmp_path / "eagle"

    monkeypatch.setattr(artifacts, "shipped_hash", lambda folder: "a newer head")  # the package's head changed
    assert eagle.find("smollm2-135m-instruct", tmp_path) == SHIPPED / "eagle"
    eagle_drafter(target)
    assert fits(caplog) == 1  # fitted again, over the stale copy
    record = json.loads((tmp_path / "eagle" / eagle.CONFIG_FILE).read_text())["tree"]
    assert record[artifacts.REFIT_KEY] == "a newer head"
    assert eagle.find("smollm2-135m-instruct", tmp_path) == tmp_path / "eagle"

    record = json.loads((tmp_path / "eagle" / eagle.CONFIG_FILE).read_text())
    del record["tree"][artifacts.REFIT_KEY]  # as a head trained here records it: no shipped source
    (tmp_path / "eagle" / eagle.CONFIG_FILE).write_text(json.dumps(record))
    monkeypatch.setattr(artifacts, "shipped_hash", lambda folder: "yet another")
    assert eagle.find("smollm2-135m-instruct", tmp_path) == tmp_path / "eagle"


def test_a_heads_hash_reads_its_file_once_until_the_file_changes(tmp_path, monkeypatch):
    """Asked on every drafter built on quantized weights: hashed again only when rewritten."""
    tensors = {"head.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    save_file(tensors, tmp_path / "heads.safetensors")
    reads = []
    real_load = artifacts.load_file
    monkeypatch.setattr(artifacts, "load_file", lambda path: reads.append(path) or real_load(path))
    first = artifacts.heads_hash(tmp_path)
    assert artifacts.heads_hash(tmp_path) == first and len(reads) == 1
    save_file({"head.weight": torch.ones(5, 4)}, tmp_path / "heads.safetensors")  # heads trained again
    assert artifacts.heads_hash(tmp_path) != first and len(reads) == 2
    save_file(tensors, tmp_path / "heads.safetensors")  # the same tensors written again: the same hash
    assert artifacts.heads_hash(tmp_path) == first
