"""A model loaded to draft reads its LM head at five bits (draft_head.py): fewer bytes a
step, nearly the same top tokens, and speculative output still exactly the target's."""

import pytest
import torch

from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.stopping import StopCondition
from specdecode.drafters import DraftModel
from specdecode.models import draft_head
from specdecode.models.native import NativeModel
from specdecode.models.quant import QuantTensor

PROMPT = [5, 17, 42, 8, 17, 42, 8, 91, 5, 17, 42]


def top_tokens(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, model.new_cache(1, 64)).logits[0].argmax(-1)


def test_a_q8_0_draft_head_runs_at_five_bits_and_speculation_stays_exact(tiny_llama, tiny_llama_other,
                                                                          kernel_module):
    target = NativeModel.from_folder(tiny_llama, torch.bfloat16, "q4_0")
    plain = NativeModel.from_folder(tiny_llama_other, torch.bfloat16, "q8_0")
    slim = NativeModel.from_folder(tiny_llama_other, torch.bfloat16, "q8_0", as_draft=True)
    assert plain.lm_head.types == ["Q8_0"] and slim.lm_head.types == ["Q5_0"]
    assert slim.lm_head.nbytes < 0.7 * plain.lm_head.nbytes
    assert slim.weight_bytes_per_token == plain.weight_bytes_per_token - plain.lm_head.nbytes + slim.lm_head.nbytes
    tokens = torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(3))
    agree = (top_tokens(slim, tokens) == top_tokens(plain, tokens)).float().mean()
    assert agree >= 0.9
    stop = StopCondition(max_new_tokens=40)
    plain_output, _ = collect(decode(target, PROMPT, stop))
    for k in (2, 5):
        assert collect(decode(target, PROMPT, stop, drafter=DraftModel(slim, target.vocab_size), k=k))[0] == plain_output


def test_a_head_no_wider_than_five_bits_is_kept_as_stored(tiny_llama, kernel_module):
    model = NativeModel.from_folder(tiny_llama, torch.bfloat16, "q4_0", as_draft=True)
    assert model.lm_head.types == ["Q4_0"]


def test_a_kept_draft_head_is_read_back_and_made_again_when_damaged(tiny_llama, tmp_path, monkeypatch, caplog):
    from specdecode.models.prepared import HEAD
    from specdecode.models.quant import quantize_matrices, QUANTIZABLE
    from specdecode.models.weights import load_weights

    weights = quantize_matrices(load_weights(tiny_llama, torch.bfloat16), QUANTIZABLE["q8_0"])
    keep = tmp_path / "model-0000.abcdef012345.draft-head.pt"
    older = tmp_path / "model-0000.000000000000.draft-head.pt"
    neighbour = tmp_path / "model-0000.5-other.000000000000.draft-head.pt"  # another file whose name shares a prefix
    for path in (older, neighbour):
        path.write_bytes(b"a head")
    made = draft_head.with_draft_head(weights, keep)[HEAD]
    assert keep.is_file() and not older.exists() and neighbour.exists()

    def no_requantizing(*args):
        raise AssertionError("requantized again")

    with monkeypatch.context() as patch:
        patch.setattr(QuantTensor, "quantize", no_requantizing)
        read = draft_head.with_draft_head(weights, keep)[HEAD]
    assert read.qtype == made.qtype and torch.equal(read.data, made.data) and torch.equal(read.layout, made.layout)
    keep.write_bytes(b"not a saved dictionary")
    with caplog.at_level("WARNING", logger="specdecode"):
        again = draft_head.with_draft_head(weights, keep)[HEAD]
    assert "unreadable" in caplog.text and torch.equal(again.data, made.data)
    assert torch.load(keep, mmap=True, weights_only=True)["qtype"] == int(made.qtype)


def write_to_a_full_disk(monkeypatch) -> None:
    """torch.save writes to /dev/full instead: the error a full disk gives, from torch's own writer."""
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda payload, path: real_save(payload, "/dev/full"))


def test_a_disk_that_refuses_the_draft_head_costs_only_the_next_requantizing(tiny_llama, tmp_path, monkeypatch,
                                                                              caplog):
    from specdecode.models.prepared import HEAD
    from specdecode.models.quant import quantize_matrices, QUANTIZABLE
    from specdecode.models.weights import load_weights

    weights = quantize_matrices(load_weights(tiny_llama, torch.bfloat16), QUANTIZABLE["q8_0"])
    keep = tmp_path / "model-0000.abcdef012345.draft-head.pt"
    write_to_a_full_disk(monkeypatch)
    with caplog.at_level("WARNING", logger="specdecode"):
        head = draft_head.with_draft_head(weights, keep)[HEAD]
    assert head.qtype.name == "Q5_0" and head.layout is not None
    assert "could not keep the draft head" in caplog.text
    assert list(tmp_path.iterdir()) == []  # neither the head nor a partial file


def test_a_failed_write_of_a_kept_file_is_an_os_error_and_leaves_nothing(tmp_path, monkeypatch):
    from specdecode.models.prepared import save_whole

    write_to_a_full_disk(monkeypatch)
    with pytest.raises(OSError, match="could not write"):
        save_whole({"format": 1}, tmp_path / "model-0000.abcdef012345.prepared.pt", ".prepared.pt")
    assert list(tmp_path.iterdir()) == []


def test_keeping_a_file_removes_what_killed_writers_left_and_spares_live_ones(tmp_path):
    """A load killed while it kept a prepared copy leaves a `.partial` (a gigabyte for a
    1.5B model): the next copy kept in that folder removes it, not a live writer's."""
    import os

    from specdecode.models.prepared import save_whole

    dead_pid = 2**22 + 12345  # above Linux's pid_max default range, so no such process
    dead = tmp_path / f".model-0000.000000000000.prepared.pt.pid{dead_pid}.partial"
    live = tmp_path / f".model-0001.000000000000.prepared.pt.pid{os.getppid()}.partial"
    for partial in (dead, live):
        partial.write_bytes(b"half a copy")
    save_whole({"format": 1}, tmp_path / "model-0000.abcdef012345.prepared.pt", ".prepared.pt")
    assert not dead.exists() and live.exists()
    assert torch.load(tmp_path / "model-0000.abcdef012345.prepared.pt", weights_only=True) == {"format": 1}


@pytest.mark.real
def test_a_gguf_draft_keeps_its_head_beside_the_prepared_copy_and_drafts_as_well(smollm2_folder, kernel_module):
    """SmolLM2's file stores its head in Q8_0: loaded to draft for itself, the five-bit head
    is kept beside the prepared copy and still proposes what the target would say."""
    from specdecode.models.prepared import prepared_path
    from specdecode.models.store import gguf_file

    gguf = gguf_file(smollm2_folder)
    path = draft_head.draft_head_path(gguf, smollm2_folder)
    path.unlink(missing_ok=True)
    target = NativeModel.from_folder(smollm2_folder, torch.bfloat16, "gguf")
    slim = NativeModel.from_folder(smollm2_folder, torch.bfloat16, "gguf", as_draft=True)
    assert target.lm_head.types == ["Q8_0"] and slim.lm_head.types == ["Q5_0"]
    assert path.is_file() and path.parent == prepared_path(gguf, smollm2_folder).parent
    prompt, stop = [1, 504, 3458, 314, 260, 1345, 282, 4194, 30, 378, 2374, 4194, 314], StopCondition(max_new_tokens=48)
    plain_output, _ = collect(decode(target, prompt, stop))
    output, done = collect(decode(target, prompt, stop, drafter=DraftModel(slim, target.vocab_size), k=4))
    assert output == plain_output
    assert done.stats.acceptance_rate >= 0.9
