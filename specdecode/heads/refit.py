"""`specdecode train medusa|eagle --reshape-only`: choose the tree of existing heads again.

A tree's best shape depends on the machine as much as on the heads: the verify curve,
the head's step and each extra path's attention call are measured where it runs, while
the heads' held-out accuracy by depth and rank is stored in the artifact at training.
Heads trained on another machine (the shipped ones) or before a kernel change
get a shape fitted to this one in a minute, without training: by this command, or on
first use where the artifact records another machine (policy/machine.py, heads/loading.py). The
artifact is written beside the target's cached weights (or to --out), where it is found
before a shipped one.
"""

from __future__ import annotations

from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.heads import artifacts, draft_vocab
from specdecode.heads.eagle import model as eagle
from specdecode.heads.eagle.train import shape_for
from specdecode.heads.medusa import model as medusa
from specdecode.heads.medusa.train import pick_tree
from specdecode.models.load import load_model
from specdecode.policy import machine


def _source(folder: Path) -> dict:
    """Where a shipped artifact was re-shaped from, so that a newer package's replaces it."""
    source = artifacts.shipped_hash(folder)
    return {} if source is None else {artifacts.REFIT_KEY: source}


def reshape_medusa(target_name: str, heads: str | Path | None = None, out: str | Path | None = None,
                   log=print, dtype: str | None = None) -> Path:
    target = load_model(target_name, dtype)
    return refit_medusa(target, Path(heads) if heads else medusa.find(target_name, target.info.folder), out, log)


def refit_medusa(target, folder: Path, out: str | Path | None = None, log=print) -> Path:
    """The heads in `folder` with a tree chosen for this machine, saved to `out` (default:
    beside the target's weights); `target` is a models.load.LoadedModel."""
    trained, config = medusa.load(folder)
    log(f"heads from {folder}: top-1 accuracy by head {[a[0] for a in config.accuracy]}")
    vocab = draft_vocab.for_target(target, trained.draft_vocab)
    paths, speedup = pick_tree(target.model, trained, vocab, config.accuracy, log)
    config.tree = [list(p) for p in paths]
    config.training = config.training | {"expected_speedup": round(speedup, 3),
                                         "fitted_on": machine.fit_record(target.model), **_source(folder)}
    out = Path(out) if out else medusa.default_dir(target.info.folder, machine.weights_of(target.model))
    return medusa.save(out, trained, config)


def reshape_eagle(target_name: str, head: str | Path | None = None, out: str | Path | None = None,
                  log=print, dtype: str | None = None) -> Path:
    target = load_model(target_name, dtype)
    return refit_eagle(target, Path(head) if head else eagle.find(target_name, target.info.folder), out, log)


def refit_eagle(target, folder: Path, out: str | Path | None = None, log=print) -> Path:
    """The head in `folder` with a tree shape chosen for this machine, saved to `out`
    (default: beside the target's weights); `target` is a models.load.LoadedModel."""
    trained = eagle.load(folder)
    accuracy = trained.config.tree.get("accuracy")
    if not accuracy:
        raise SpecDecodeError(f"the head in {folder} stores no held-out accuracy to choose a shape from; "
                              "train it again with `specdecode train eagle`")
    log(f"head from {folder}")
    vocab = trained.vocabulary(target)
    kept = {k: v for k, v in trained.config.tree.items() if k == artifacts.REFIT_KEY}  # a refit's refit
    trained.config.tree = shape_for(target.model, trained, vocab, accuracy, log) | kept | _source(folder)
    out = Path(out) if out else eagle.default_dir(target.info.folder, machine.weights_of(target.model))
    return eagle.save(out, trained.float())
