"""`train --reshape-only`: the shipped SmolLM2 heads get a tree chosen on this machine,
the weights untouched, written where asked."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specdecode import eagle, medusa
from specdecode.training.reshape import reshape_eagle, reshape_medusa

SHIPPED = medusa.SHIPPED / "smollm2-135m-instruct"


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
def test_reshape_eagle_keeps_the_head_and_its_accuracy(tmp_path):
    folder = reshape_eagle("smollm2-135m-instruct", SHIPPED / "eagle", tmp_path / "eagle", log=lambda _: None)
    tree = json.loads((folder / eagle.CONFIG_FILE).read_text())["tree"]
    shipped = json.loads((SHIPPED / "eagle" / eagle.CONFIG_FILE).read_text())["tree"]
    assert tree["accuracy"] == shipped["accuracy"]
    assert {"depth", "top_k", "num_nodes", "expected_speedup"} <= set(tree) and tree["expected_speedup"] >= 1.0
    for name, tensor in load_file(folder / eagle.WEIGHTS_FILE).items():
        assert torch.equal(tensor, load_file(SHIPPED / "eagle" / eagle.WEIGHTS_FILE)[name]), name
