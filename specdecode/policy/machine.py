"""Which machine a measured cost belongs to.

A tree drafter's shape (Medusa, EAGLE) and its on/off gate rest on costs measured where
the shape was chosen: the verify pass over 1, 2, ... tokens and the head's step, in
target steps. Those ratios move with the CPU and its kernels: the SmolLM2 heads shipped
with the package were fitted on an Intel CPU with AMX, where a verify pass of four tokens
costs little more than one; on an AMD Zen 3 (AVX2) the same trees ran at 0.82-0.97x of
plain decoding, and refitted there at 0.91-1.13x (docs/benchmarks.md). The target's
weights move them as much: on AMD EPYC Zen 4 a pass over 8 tokens costs 1.13 one-token
passes in bf16 and about 2.2 on the GGUF's Q4_K_M blocks, and Medusa's 11-node tree
fitted for bf16 ran the quantized target at half its plain rate. So a shape records the
machine and the weights it was fitted on (`fit_record`), and one fitted elsewhere, on
other weights, or before the kernels changed, is fitted again.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.models.kernels import kernel_kind, source_tag


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def fingerprint() -> dict:
    """What a cost measured here depends on: the CPU, the kernels running (their build and
    the version of their sources), the threads."""
    kind = kernel_kind()
    return {"cpu": cpu_model(), "kernel": kind or "none", "kernel_sources": source_tag(kind) if kind else "none",
            "threads": torch.get_num_threads()}


def weights_of(model) -> str:
    """A model's weights as its costs depend on them: the float dtype ("bfloat16",
    "float32") or the quantized format ("gguf", "q8_0", "q4_0")."""
    return getattr(model, "weight_format", None) or str(model.dtype).removeprefix("torch.")


def fit_record(model) -> dict:
    """What a tree fitted to `model`'s costs on this machine records as `fitted_on`."""
    return fingerprint() | {"weights": weights_of(model)}


def fitted_elsewhere(fitted_on: dict | None, weights: str | None = None) -> bool:
    """Whether costs recorded on `fitted_on` came from another machine than this one or,
    where `weights` is given, from a target with other weights. Only the keys it records
    count; an artifact that records none is taken as it is."""
    if not fitted_on:
        return False
    here = fingerprint() | ({"weights": weights} if weights else {})
    if "kernel" in fitted_on and "kernel_sources" in here and "kernel_sources" not in fitted_on:
        return True  # fitted before the kernels' version was recorded: which kernels is unknown
    if "weights" in here and "weights" not in fitted_on:
        return True  # fitted before the weights were recorded: bf16 or quantized is unknown
    return any(key in here and here[key] != value for key, value in fitted_on.items())


def describe(fitted_on: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in fitted_on.items())
