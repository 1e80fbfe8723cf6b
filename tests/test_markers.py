"""The fast subset, `pytest -m "not real and not qwen"`, loads no registry model: the
fixtures that load one mark their tests, and an unmarked test that reaches one fails."""

import pytest

from tests import conftest


class Item:
    """What pytest_collection_modifyitems reads of a test: its fixtures and markers."""

    def __init__(self, fixturenames, markers=()):
        self.fixturenames, self.markers = fixturenames, set(markers)

    def add_marker(self, marker):
        self.markers.add(marker)

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_the_model_fixtures_mark_their_tests():
    smol, qwen, tiny, marked = (Item(["smollm2_folder", "tmp_path"]), Item(["qwen_folder"]), Item(["tiny_llama"]),
                                Item([], ["qwen"]))
    conftest.pytest_collection_modifyitems(None, [smol, qwen, tiny, marked])
    assert (smol.markers, qwen.markers, tiny.markers, marked.markers) == ({"real"}, {"real", "qwen"}, set(),
                                                                          {"real", "qwen"})


def test_an_unmarked_test_that_loads_a_registry_model_fails():
    from specdecode.api import load_model
    from specdecode.models import store

    with pytest.raises(pytest.fail.Exception, match=r"mark it @pytest.mark.real$"):
        load_model("smollm2-135m-instruct")
    with pytest.raises(pytest.fail.Exception, match=r"mark it @pytest.mark.real and @pytest.mark.qwen"):
        store.resolve("qwen2.5-coder-0.5b-instruct")


@pytest.mark.real
def test_a_real_test_still_needs_qwen_for_the_qwen_pair():
    from specdecode.models import store

    with pytest.raises(pytest.fail.Exception, match=r"mark it @pytest.mark.qwen$"):
        store.pull("qwen2.5-coder-1.5b-instruct", progress=False)
