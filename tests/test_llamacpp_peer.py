"""llama.cpp as a bench peer: skipped with a reason where it cannot run, and, where the
optional binding is installed, run on the target's own GGUF file."""

import sys

import pytest

from specdecode.commands import llamacpp_peer


def test_without_the_binding_the_peer_is_skipped_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when not installed
    assert "pip install -e '.[llamacpp]'" in llamacpp_peer.unavailable(0.0)


def test_sampling_is_not_offered_to_the_peer():
    assert llamacpp_peer.unavailable(0.7) == "it runs greedy decoding only"


def test_a_build_that_crashes_in_its_test_process_is_skipped_with_the_signal():
    """The binding runs in-process: a build that faults (GCC 12's AMX code does) must be
    found in a process of its own, or it would take the bench down with it."""
    segfault = (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    why = llamacpp_peer.crashes(segfault)
    assert why.startswith("llama.cpp crashed (SIGSEGV) on a test pass over 16 tokens")
    failing = (sys.executable, "-c", "raise SystemExit('no such file')")
    assert "failed (no such file)" in llamacpp_peer.crashes(failing)
    assert llamacpp_peer.crashes((sys.executable, "-c", "pass")) is None


@pytest.mark.real
def test_a_working_build_passes_its_test_pass_on_the_targets_gguf(smollm2_folder):
    if llamacpp_peer.unavailable(0.0) is not None:
        pytest.skip(llamacpp_peer.unavailable(0.0))
    gguf, why = llamacpp_peer.target_gguf(smollm2_folder, 0.0)
    assert why is None and gguf.suffix == ".gguf"


@pytest.mark.real
def test_the_peer_decodes_greedily_on_the_targets_gguf_to_the_budget(smollm2_folder):
    why = llamacpp_peer.unavailable(0.0)
    if why is not None:  # an optional extra: absent from the default install
        pytest.skip(why)
    from specdecode.models.store import gguf_file

    runs = llamacpp_peer.peer_runs(gguf_file(smollm2_folder), 2, 12, eos=(), lookup_k=3, context=512)
    assert [name for name, _, _ in runs] == ["llama.cpp plain", "llama.cpp prompt-lookup"]
    prompt = [1, 504, 3303, 282, 253, 1345, 30, 198]
    outputs = [run(prompt, "chat") for _, _, run in runs]
    for seconds, tokens, first in outputs:
        assert 0 < first < seconds and len(tokens) == 12
    assert outputs[0][1] == outputs[1][1]  # its prompt lookup keeps its own greedy output
    assert runs[0][2](prompt, "chat")[1] == outputs[0][1]  # a repeat prefills again and decodes the same


@pytest.mark.real
def test_speed_times_the_peer_on_the_same_prompt(smollm2_folder):
    why = llamacpp_peer.unavailable(0.0)
    if why is not None:
        pytest.skip(why)
    from specdecode.models.store import gguf_file

    run = llamacpp_peer.plain_runner(gguf_file(smollm2_folder), 2, list(range(300, 400)), 8)
    timings = [run(), run()]  # each call one timed run, as `speed` interleaves them with its own
    assert all(prefill > 0 and decode > 0 for prefill, decode in timings)
