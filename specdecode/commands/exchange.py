"""`specdecode export` and `specdecode import`: heads trained here to the formats vLLM and
SGLang load (speculators, the EAGLE repository's, vLLM's Medusa), and EAGLE-3 heads made
elsewhere into drafters here, their tree fitted to this machine."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.heads.draft_vocab import lm_head_weight
from specdecode.heads.eagle import exchange as eagle_exchange
from specdecode.heads.eagle import model as eagle
from specdecode.heads.eagle.train import depth_accuracy, documents, shape_for
from specdecode.heads.medusa import exchange as medusa_exchange
from specdecode.heads.medusa import model as medusa
from specdecode.heads.training.data import training_features
from specdecode.models.load import load_model
from specdecode.models.registry import REGISTRY

# The sample an imported head's accuracy by depth is measured on (the target's answers to
# built-in instructions and standard-library source): its tree is chosen from it.
IMPORT_ANSWERS, IMPORT_ANSWER_TOKENS, IMPORT_SOURCE_TOKENS = 16, 96, 4000
FEATURES_DIR = "import-features"


def verifier_of(target) -> str:
    """What an exported head names as its verifier: the publisher's id of the weights a
    registry target quantizes, else the target's own folder."""
    spec = REGISTRY.get(target.info.source)
    return spec.origin if spec is not None and spec.origin else str(target.info.folder)


def export_eagle(target_name: str, head_dir: str | None, out: str, fmt: str, k: int | None,
                 verifier: str | None, log=print) -> Path:
    target = load_model(target_name)
    folder = head_dir or eagle.find(target.info.source, target.info.folder)
    head = eagle.load(folder)
    if head.config.target_sha256 and target.info.sha256 and head.config.target_sha256 != target.info.sha256:
        raise SpecDecodeError(f"the head in {folder} was trained on {head.config.target}, not on {target_name}")
    config = json.loads((Path(target.info.folder) / "config.json").read_text())
    k = k or free_verify_chain(head.config.tree)
    name = verifier or verifier_of(target)
    done = eagle_exchange.export(head, out, name, config.get("architectures") or [], config["vocab_size"],
                                 config.get("max_position_embeddings", 4096), k, fmt)
    log(f"exported the EAGLE-3 head in {folder} ({fmt} layout, {k} speculative token{'s' * (k > 1)}) to {done}")
    log(deploy_hint("eagle3", name, done, k))
    return done


def free_verify_chain(tree: dict, longest: int = 8) -> int:
    """The draft length that pays most where verifying it costs one target pass (a GPU):
    expected tokens 1 + Σ_d Π_{i<=d} a_i from the head's held-out top-1 accuracy by depth,
    over 1 + k·r, r its step's cost measured here in target steps. 3 where the head
    stores neither (imported, or trained before they were recorded)."""
    accuracy, ratio = [row[0] for row in tree.get("accuracy") or []], tree.get("head_step_ratio")
    if not accuracy or ratio is None:
        return 3
    rates, expected, reach = [], 1.0, 1.0
    for k, a in enumerate(accuracy[:longest], start=1):
        reach *= a
        expected += reach
        rates.append(expected / (1 + k * ratio))
    return 1 + rates.index(max(rates))


def export_medusa(target_name: str, heads_dir: str | None, out: str, verifier: str | None, log=print) -> Path:
    target = load_model(target_name)
    folder = heads_dir or medusa.find(target.info.source, target.info.folder)
    heads, config = medusa.load(folder)
    if config.target_sha256 and target.info.sha256 and config.target_sha256 != target.info.sha256:
        raise SpecDecodeError(f"the heads in {folder} were trained on {config.target}, not on {target_name}")
    done = medusa_exchange.export(heads, config, lm_head_weight(target), out)
    log(f"exported {heads.num_heads} Medusa heads from {folder} to {done}")
    log(deploy_hint("medusa", verifier or verifier_of(target), done, heads.num_heads))
    return done


def deploy_hint(method: str, verifier: str, folder: Path, k: int) -> str:
    spec = json.dumps({"method": method, "model": str(folder), "num_speculative_tokens": k})
    return f"vllm serve {shlex.quote(verifier)} --speculative-config {shlex.quote(spec)}"


def import_eagle(source: str, target_name: str, out: str | None, any_verifier: bool, log=print) -> Path:
    """The head in `source` (speculators or EAGLE layout) as an artifact here, bound to the
    target, with a tree chosen from its accuracy on a sample of the target's text."""
    eagle_exchange.read_config(source)  # a wrong folder fails before the target loads
    target = load_model(target_name)
    head, meta = eagle_exchange.read(source, target.model.config.num_layers)
    head = eagle_exchange.match_target(head, meta, target, any_verifier)
    folder = Path(out) if out else eagle.default_dir(target.info.folder)
    if out is None and (folder / eagle.CONFIG_FILE).is_file():
        raise SpecDecodeError(f"a head is already at {folder}; pass --out DIR to import beside it")
    layers = tuple(sorted(set(head.config.feature_layers) | {target.model.config.num_layers}))
    features = training_features(target, layers, IMPORT_SOURCE_TOKENS, IMPORT_ANSWERS, IMPORT_ANSWER_TOKENS,
                                 Path(target.info.folder) / FEATURES_DIR, log)
    drafting = head.to(target.model.dtype).pack_for_drafting()
    vocab = drafting.vocabulary(target)
    docs = documents(features, torch.arange(len(features)))  # the head never saw any of them
    accuracy = depth_accuracy(drafting, target.model, vocab, features, docs)
    head.config.tree = shape_for(target.model, drafting, vocab, accuracy, log)
    head.config.training = {"imported_from": str(source), "format": meta["format"], "verifier": meta["verifier"],
                            "speculative_tokens": meta["speculative_tokens"]}
    saved = eagle.save(folder, head.float())
    log(f"imported the head from {source} to {saved}")
    return saved
