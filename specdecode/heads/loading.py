"""A Medusa or EAGLE drafter for a loaded target: its artifact found, checked against the
target, and its tree fitted to this machine and the target's weights when it was fitted
on another machine or other weights.

A tree drafter's shape and gate rest on costs measured where the shape was chosen
(policy/machine.py). An artifact found for the target but fitted elsewhere (the shipped
SmolLM2 heads), or for bf16 when the target runs on quantized blocks, is fitted again
here once, into the target's folder (heads/artifacts.py: one folder per kind of
weights), where it is found the next time; one named by the user's path is left as it
is, with a warning that says how to refit it.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Callable

from specdecode.errors import SpecDecodeError
from specdecode.heads import draft_vocab, refit
from specdecode.heads.eagle import exchange
from specdecode.heads.eagle import model as eagle
from specdecode.heads.eagle.drafter import EagleDrafter
from specdecode.heads.medusa import model as medusa
from specdecode.heads.medusa.drafter import MedusaDrafter
from specdecode.models.load import LoadedModel
from specdecode.policy import machine
from specdecode.policy.gate import TreeGate
from specdecode.policy.tree_shapes import expected_tokens_of_tree

log = logging.getLogger("specdecode")


def medusa_drafter(target: LoadedModel, heads: str | None = None) -> MedusaDrafter:
    """Medusa heads from a folder, or the ones trained (or shipped) for this target."""
    weights = machine.weights_of(target.model)
    folder = heads or medusa.find(target.info.source, target.info.folder, weights)
    trained, config = medusa.load(folder)
    if config.target_sha256 and target.info.sha256 and config.target_sha256 != target.info.sha256:
        raise SpecDecodeError(f"the heads in {folder} were trained on {config.target} "
                              f"(sha256 {config.target_sha256[:12]}), not on this target")
    refitted = fit_to_machine("Medusa heads' tree", "medusa", config.training.get("fitted_on"), weights, heads,
                              lambda: refit.refit_medusa(target, Path(folder), log=lambda _: None))
    if refitted is not None:
        trained, config = medusa.load(refitted)
    paths = [tuple(p) for p in config.tree]
    gate = tree_gate(expected_tokens_of_tree(paths, config.accuracy), config.training.get("expected_speedup"))
    return MedusaDrafter(target.model, trained, paths, draft_vocab.for_target(target, trained.draft_vocab), gate)


def eagle_drafter(target: LoadedModel, head: str | None = None) -> EagleDrafter:
    """An EAGLE head from a folder, or the one trained (or shipped) for this target."""
    weights = machine.weights_of(target.model)
    folder = head or eagle.find(target.info.source, target.info.folder, weights)
    if head is not None and not (Path(head) / eagle.CONFIG_FILE).is_file() and (Path(head) / "config.json").is_file():
        return foreign_eagle_drafter(target, Path(head))
    trained = eagle.load(folder)
    sha = trained.config.target_sha256
    if sha and target.info.sha256 and sha != target.info.sha256:
        raise SpecDecodeError(f"the head in {folder} was trained on {trained.config.target}, not on this target")
    refitted = fit_to_machine("EAGLE head's tree", "eagle", trained.config.tree.get("fitted_on"), weights, head,
                              lambda: refit.refit_eagle(target, Path(folder), log=lambda _: None))
    if refitted is not None:
        trained = eagle.load(refitted)
    shape = trained.config.tree  # chosen when training from measured acceptance and costs
    return EagleDrafter(target.model, trained, **{k: shape[k] for k in ("depth", "top_k", "num_nodes") if k in shape},
                        vocab=trained.vocabulary(target),
                        gate=tree_gate(shape.get("expected_tokens"), shape.get("expected_speedup")))


def foreign_eagle_drafter(target: LoadedModel, folder: Path) -> EagleDrafter:
    """A head in vLLM's speculators or the EAGLE layout, used as it is: a chain as long as
    its config proposes, always on; `specdecode import eagle` fits its tree and gate here."""
    head, meta = exchange.read(folder, target.model.config.num_layers)
    trained = exchange.match_target(head, meta, target)
    depth = int(meta["speculative_tokens"] or 3)
    warnings.warn(f"the head in {folder} drafts a chain of {depth}, unfitted to this machine; "
                  f"`specdecode import eagle {folder} --target {target.info.source}` fits its tree here", stacklevel=3)
    return EagleDrafter(target.model, trained, depth=depth, top_k=1, num_nodes=depth, vocab=trained.vocabulary(target))


def fit_to_machine(what: str, kind: str, fitted_on: dict | None, weights: str, given: str | None,
                   fit: Callable[[], Path]) -> Path | None:
    """The folder of a tree drafter fitted again to this machine and the target's `weights`
    because its shape was fitted on another machine or other weights. None where it stays
    as it is: fitted here, or named by the user's path (a warning says how to refit it),
    or where the refit cannot be saved."""
    if not machine.fitted_elsewhere(fitted_on, weights):
        return None
    if given is not None:
        warnings.warn(f"the {what} in {given} was fitted on another machine or weights "
                      f"({machine.describe(fitted_on)}; here {weights}); "
                      f"`specdecode train {kind} --reshape-only --from {given}` fits it to this one", stacklevel=3)
        return None
    log.warning("fitting the %s to this machine and %s weights (once, under a minute; it was fitted on %s)...",
                what, weights, machine.describe(fitted_on))
    try:
        return fit()
    except OSError as e:  # a target folder we may not write to
        warnings.warn(f"the {what} fitted to this machine could not be saved ({e}); it runs as fitted", stacklevel=3)
        return None


def tree_gate(expected_tokens: float | None, expected_speedup: float | None) -> TreeGate | None:
    """The on/off gate of a tree drafter whose shape was chosen to emit `expected_tokens` a
    round at `expected_speedup`: a round costs their ratio in plain steps. None (always on)
    for an artifact that stores neither."""
    if not expected_tokens or not expected_speedup:
        return None
    return TreeGate(round_cost=expected_tokens / expected_speedup, prior_tokens=expected_tokens)
