"""Costs measured once on this machine, for the default draft-length policy.

Without a profile from `specdecode tune`, the adaptive policy (adaptive.py) still needs
the verify curve v(n) (a target pass over n tokens / over one) and the draft step's cost
c, and both move with the CPU: a pass over 8 tokens costs 1.1x one token on a CPU with
AMX and about 2x on an AVX2-only one. Constants measured on one machine made speculation
slower than plain decoding on another, so the first generation with a drafter on a new
(target, draft, dtype, machine) times a few passes (seconds) and caches the figures under
$SPECDECODE_HOME/costs; later runs read them back.

Costs depend on the models' shapes and dtype, not on their weights, so the cache key is
the shapes, the dtype, the machine's fingerprint (machine.py) and the version of its
kernels (a new version measures again).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from specdecode.models import kernels
from specdecode.models.store import home
from specdecode.policy import machine
from specdecode.policy.adaptive import CATCH_UP_ROWS, CostModel
from specdecode.policy.costs import cost_model, measure_passes

log = logging.getLogger("specdecode")

PROBE_SIZES = (1, 2, 3, 4, 5, 7, 9)  # rows of a verify pass: k + 1 for k up to 8
PROBE_CONTEXT = 128
# Rounds timed after a warm-up. Probes of nine rounds, against probes of three cut from the
# same minutes (a noisy 2-core AMD EPYC Zen 4, 2026-12-07): c's standard deviation 0.030
# against 0.039, v(5)'s 0.17 against 0.32. Seven rounds take about 4 s, once.
PROBE_REPEATS = 7
# A draft model's step inside a generation costs more than its one-token pass alone: the
# first pass of each round feeds the target's accepted tokens and its correction (a
# catch-up over CATCH_UP_ROWS rows). The probe times that pass too; c is their mean per draft.
# Reading a prompt it has not seen is a pass over many rows: its cost per token is timed on
# PROMPT_ROWS (the adaptive policy's `start_pays`).
PROMPT_ROWS = 64


def shape_of(model) -> str:
    """What a pass's cost depends on: the architecture's size and the dtype."""
    return f"{type(model).__name__}:{model.weight_bytes_per_token}:{model.vocab_size}:{model.dtype}"


def cache_path(target_model, draft_model) -> Path:
    kind = kernels.kernel_kind()
    key = json.dumps([shape_of(target_model), shape_of(draft_model) if draft_model is not None else None,
                      machine.fingerprint(), kernels.source_tag(kind) if kind else None, PROBE_SIZES, CATCH_UP_ROWS,
                      PROMPT_ROWS, PROBE_REPEATS])
    return home() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def measure(target_model, draft_model=None) -> dict:
    """Seconds of the target's passes over n rows (PROBE_SIZES), of the draft model's step as
    a generation pays it and of its reading per context token (None without a draft model),
    timed interleaved."""
    passes = {str(n): (target_model, n) for n in PROBE_SIZES}
    if draft_model is not None:
        passes |= {f"draft {n}": (draft_model, n) for n in (1, CATCH_UP_ROWS, PROMPT_ROWS)}
    seconds = measure_passes(passes, PROBE_CONTEXT, PROBE_REPEATS)
    draft_step = catch_up_token = None
    if draft_model is not None:  # a round of k drafts: one catch-up pass, then k - 1 one-row passes
        draft_step = (seconds["draft 1"] + seconds[f"draft {CATCH_UP_ROWS}"]) / 2
        catch_up_token = seconds[f"draft {PROMPT_ROWS}"] / PROMPT_ROWS
    return {"verify_seconds": {n: seconds[str(n)] for n in PROBE_SIZES}, "draft_step_s": draft_step,
            "catch_up_token_s": catch_up_token, "machine": machine.fingerprint()}


def measured_costs(target_model, draft_model=None) -> CostModel:
    """The cost model of drafting with draft_model (None: a drafter that costs nothing, as
    prompt lookup) for target_model on this machine: read from the cache, or measured
    once and cached."""
    path = cache_path(target_model, draft_model)
    try:
        figures = json.loads(path.read_text())
        verify = {int(n): s for n, s in figures["verify_seconds"].items()}
        draft_step, catch_up_token = figures["draft_step_s"], figures["catch_up_token_s"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: measure again
        log.warning("measuring this machine's verify and draft costs, once (a few seconds)...")
        figures = measure(target_model, draft_model)
        verify, draft_step, catch_up_token = figures["verify_seconds"], figures["draft_step_s"], figures["catch_up_token_s"]
        write_figures(path, figures)
    return cost_model(verify, draft_step or 0.0, catch_up_token or 0.0)


def write_figures(path: Path, figures: dict) -> None:
    """Cache measured figures as JSON; never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(figures, indent=1))
    partial.replace(path)
