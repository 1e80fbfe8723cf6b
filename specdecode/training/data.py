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
