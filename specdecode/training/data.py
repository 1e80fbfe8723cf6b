"""The training set of a drafter head: documents -> target features, cached for resumes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .corpus import instruction_prompts, stdlib_documents
from .features import Features, collect

CHUNK = 512  # tokens per teacher-forced pass
FEATURES_DIR = "training-features"  # beside the target's cached weights, shared by every head


def answer_documents(target, num_answers: int, answer_tokens: int, log=print) -> list[list[int]]:
    """Chat-templated prompt + the target's own greedy answer, for the first prompts."""
    from tqdm import tqdm

    from ..drafters import PromptLookup
    from ..engine import decode
    from ..events import collect as collect_events
    from ..prompts import encode_prompt
    from ..stopping import StopCondition

    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=answer_tokens)
    documents = []
    for prompt in tqdm(instruction_prompts()[:num_answers], desc="target answers", unit="prompt"):
        prompt_ids = encode_prompt(target.tokenizer, prompt)[-CHUNK:]
        answer, _ = collect_events(decode(target.model, prompt_ids, stop, drafter=PromptLookup(), k=4))
        documents.append((prompt_ids + answer)[-CHUNK:])
    return documents


def training_features(target, layers: tuple[int, ...], num_tokens: int, num_answers: int, answer_tokens: int,
                      work: Path, log=print) -> Features:
    """Features of the target's answers and of standard-library source (num_tokens of it);
    computed once per setting, then read from the work folder."""
    from tqdm import tqdm

    key = json.dumps([target.info.sha256, layers, num_tokens, num_answers, answer_tokens, CHUNK])
    path = work / f"features-{hashlib.sha256(key.encode()).hexdigest()[:12]}.safetensors"
    if path.is_file():
        log(f"reusing the target's features from {path}")
        return Features.load(path)
    work.mkdir(parents=True, exist_ok=True)
    documents = answer_documents(target, num_answers, answer_tokens, log) if num_answers else []
    documents += stdlib_documents(target.tokenizer, num_tokens, CHUNK)
    bar = tqdm(total=sum(map(len, documents)), desc="target features", unit="tok")
    features = collect(target.model, documents, layers, progress=bar.update)
    bar.close()
    features.save(path)
    return features


def prepare(target_name: str, out, default_dir, num_tokens: int, num_answers: int, answer_tokens: int,
            epochs: float, what: str, log=print):
    """What every `specdecode train` does first: check the settings, load the target, make
    the work folder beside the artifact, and get the target's features (cached and shared).
    The artifact folder is `out`, else default_dir(the target's cached folder). Returns
    (target, features, artifact folder, work folder)."""
    from ..api import load_model
    from ..errors import SpecDecodeError

    if num_tokens < 0 or num_answers < 0 or epochs <= 0:
        raise SpecDecodeError("--tokens, --answers and --epochs must be positive")
    target = load_model(target_name)
    if not hasattr(target.model, "lm_head_weight"):
        raise SpecDecodeError(f"{what} needs the native backend (a Llama-family target)")
    folder = Path(out) if out else default_dir(target.info.folder)
    work = folder.with_name(folder.name + ".work")  # the checkpoint, for resuming
    work.mkdir(parents=True, exist_ok=True)
    features = training_features(target, (target.model.config.num_layers,), num_tokens, num_answers,
                                 answer_tokens, Path(target.info.folder) / FEATURES_DIR, log)
    log(f"{len(features)} positions of target features")
    return target, features, folder, work
