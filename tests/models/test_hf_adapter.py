"""Architectures the native forward does not implement run through the transformers adapter."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from specdecode.drafters import DraftModel, PromptLookup
from specdecode.core.engine import decode
from specdecode.core.events import collect
from specdecode.models.hf_adapter import HFModel
from specdecode.models.load import _load_model
from specdecode.core.stopping import StopCondition


@pytest.mark.slow
def test_other_architecture_falls_back_and_decodes_like_transformers(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=None, eos_token_id=None)
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    model = _load_model(tmp_path, torch.float32, "auto")
    assert isinstance(model, HFModel)

    prompt = [3, 9, 27, 3, 9, 27, 3, 9]
    ids = torch.tensor([prompt])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    stop = StopCondition(max_new_tokens=20)

    def run(**kw):
        return collect(decode(model, prompt, stop, **kw))[0]

    assert run() == expected
    # chains verify through the adapter too: its cache rewinds by cropping
    assert run(drafter=PromptLookup(), k=3) == expected
    assert run(drafter=DraftModel(model, model.vocab_size), k=3) == expected
