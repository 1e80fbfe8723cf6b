"""The shipped SmolLM2 EAGLE head, exported, against a real consumer (the `speculators`
package, which vLLM's format comes from) and imported back.

`speculators` 0.9.0 pins transformers <= 5.19, so it runs in its own virtual environment,
built once (about 3 minutes) under $SPECDECODE_HOME/test-envs and reused. Only the
packages its EAGLE-3 model imports are installed (its torchvision/torchaudio requirement
would pull a CUDA build of torch); torch is the same CPU build as this project's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode.commands.exchange import export_eagle, import_eagle
from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.core.prompts import encode_prompt
from specdecode.core.stopping import StopCondition
from specdecode.heads.eagle import model as eagle
from specdecode.heads.eagle.drafter import EagleDrafter
from specdecode.heads.eagle.parts import HeadCache
from specdecode.heads.loading import eagle_drafter
from specdecode.models.load import load_model
from specdecode.models.store import home

pytestmark = pytest.mark.real

TARGET = "smollm2-135m-instruct"
ENV_PACKAGES = [["torch==2.13.0"], ["--no-deps", "speculators==0.9.0"],
                ["transformers==5.19.0", "pydantic", "pydantic-settings", "loguru", "safetensors", "openai",
                 "datasets==5.1.0", "hs-connectors==0.9.0"]]
STEPS = 3  # draft depths compared
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test."


@pytest.fixture(scope="session")
def speculators_python() -> Path:
    env = home() / "test-envs" / "speculators-0.9.0"
    python = env / "bin" / "python"
    ready = env / ".ready"
    if not ready.is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        for packages in ENV_PACKAGES:
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages],
                           check=True)
        ready.write_text("ok\n")
    return python


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET)


@pytest.fixture(scope="module")
def text(target):
    """The prompt and the target's own greedy answer: text the head drafts on."""
    prompt = encode_prompt(target.tokenizer, PROMPT)
    answer, _ = collect(decode(target.model, prompt, StopCondition(frozenset(), max_new_tokens=300)))
    return prompt + answer


def our_drafts(head, target, tokens: list[int], steps: int) -> torch.Tensor:
    """(drafts, hidden, next tokens, embedding): drafts (steps, T) are the target token ids
    the head proposes, computed here as speculators' training-time test does: step 1 from
    the target's layers, each later step from the head's own states beside the true next
    tokens, attending to the context and its own chain."""
    model = target.model
    ids = torch.tensor(tokens)
    out = model(ids[None], model.new_cache(1, len(tokens) + 1), hidden_layers=head.layers(model.config.num_layers))
    hidden = {layer: h[0, :-1].float() for layer, h in out.hidden_states.items()}
    T = len(tokens) - 1
    embed = model.embed.float()
    positions, nxt = torch.arange(T), ids[1:]
    cache, causal = HeadCache(), torch.ones(T, T, dtype=torch.bool).tril()
    states = head(head.target_features(hidden, model.config.num_layers), embed[nxt], positions, cache)
    drafts = []
    for step in range(steps):
        logits = head.lm_head(head.readout(states))
        drafts.append(head.draft_vocab[logits.argmax(-1)])
        if step + 1 < steps:
            shifted = torch.cat([nxt[step + 1:], torch.zeros(step + 1, dtype=torch.long)])
            mask = torch.cat([causal] + [torch.eye(T, dtype=torch.bool)] * (step + 1), dim=1)
            states = head(states, embed[shifted], positions + step + 1, cache, mask)
    return torch.stack(drafts), hidden, nxt, embed


def test_the_exported_head_drafts_in_speculators_what_it_drafts_here(speculators_python, target, text, tmp_path):
    out = export_eagle(TARGET, None, str(tmp_path / "head"), "speculators", None, None, log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    config["speculators_config"]["verifier"]["name_or_path"] = str(target.info.folder)  # offline: its config
    (out / "config.json").write_text(json.dumps(config))
    head = eagle.load(eagle.find(TARGET, target.info.folder))  # fp32, plain products
    ours, hidden, nxt, embed = our_drafts(head, target, text, STEPS)
    T = nxt.numel()
    assert T >= 300
    save_file({"hidden": torch.cat([hidden[layer] for layer in head.config.feature_layers], dim=-1).contiguous(),
               "input_ids": nxt.contiguous(), "positions": torch.arange(T), "embed": embed.contiguous()},
              tmp_path / "inputs.safetensors")
    script = Path(__file__).with_name("speculators_drafts.py")
    run = subprocess.run([str(speculators_python), str(script), str(out), str(tmp_path / "inputs.safetensors"),
                          str(tmp_path / "drafts.safetensors"), str(STEPS)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(tmp_path / "drafts.safetensors")["drafts"]
    for step in range(STEPS):
        kept = T - step  # later steps' last positions read padding in both; compared all the same
        differ = (ours[step, :kept] != theirs[step, :kept]).nonzero()[:, 0].tolist()
        assert not differ, f"step {step + 1}: {len(differ)} of {kept} positions differ, first {differ[:5]}"
    accepted = (ours[0, :-1] == nxt[1:]).float().mean()
    assert accepted > 0.3  # a trained head: its first draft is the target's next token often


def test_export_then_import_drafts_identically_and_keeps_greedy_output(target, tmp_path):
    shipped = eagle_drafter(target)
    out = export_eagle(TARGET, None, str(tmp_path / "head"), "eagle", 2, None, log=lambda _: None)
    folder = import_eagle(str(out), TARGET, str(tmp_path / "imported"), False, log=lambda _: None)
    imported = eagle.load(folder)
    assert imported.config.target_sha256 == target.info.sha256
    assert imported.config.tree["accuracy"][0][0] > 0.3  # measured here on the target's own text
    shape = {"depth": 3, "top_k": 2, "num_nodes": 6}  # one tree for both, whatever each fitted
    drafters = [EagleDrafter(target.model, shipped.head, **shape, vocab=shipped.vocab),
                EagleDrafter(target.model, imported, **shape, vocab=imported.vocabulary(target))]
    prompt = encode_prompt(target.tokenizer, PROMPT)
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=80)
    plain, _ = collect(decode(target.model, prompt, stop))
    proposals = []
    for drafter in drafters:
        seen, propose = [], drafter.propose_tree
        drafter.propose_tree = lambda *a, seen=seen, propose=propose: seen.append(propose(*a)) or seen[-1]
        tokens, done = collect(decode(target.model, prompt, stop, drafter=drafter))
        assert tokens == plain
        assert done.stats.accepted_tokens > 0
        proposals.append([p.tokens.tolist() for p in seen])
    assert proposals[0] == proposals[1]


def test_a_speculators_folder_drafts_as_it_is_with_a_warning(target, tmp_path):
    out = export_eagle(TARGET, None, str(tmp_path / "head"), "speculators", 3, None, log=lambda _: None)
    with pytest.warns(UserWarning, match="unfitted to this machine.*specdecode import eagle"):
        drafter = eagle_drafter(target, str(out))
    assert (drafter.depth, drafter.top_k) == (3, 1)
    prompt = encode_prompt(target.tokenizer, PROMPT)
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=40)
    assert collect(decode(target.model, prompt, stop, drafter=drafter))[0] == collect(decode(target.model, prompt, stop))[0]
