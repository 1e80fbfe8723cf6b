"""Shared fixtures: tiny seeded random models (saved as transformers folders) and real models."""

from __future__ import annotations

import pytest
import torch

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def save_tiny(folder, kind: str = "llama", seed: int = 0, **overrides) -> str:
    """A random transformers model of the given family, saved to folder; returns its path."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    config = cls(**{**TINY, **overrides}, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # spread the logits so greedy choices are not near ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(params=["this machine's", "AVX2-only"])
def bf16_path(request, monkeypatch):
    """Run a bf16 test on this machine's own kernels, then as a CPU without AVX-512 runs it
    (AMD Zen 3, say): no AMX kernel, no oneDNN packing, torch's ops and F.linear."""
    if request.param == "AVX2-only":
        from specdecode.models import kernels, linear

        monkeypatch.setattr(kernels, "kernel", lambda: None)
        monkeypatch.setattr(linear, "onednn_packs_bf16", lambda: False)
    return request.param


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_other(tmp_path_factory):
    """An independent tiny model with the same vocabulary: a poor drafter for tiny_llama."""
    return save_tiny(tmp_path_factory.mktemp("tiny_llama_other"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def smollm2_folder():
    from specdecode.models.store import resolve

    return resolve("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_folder():
    from specdecode.models.store import resolve

    return resolve("qwen2.5-coder-1.5b-instruct")
