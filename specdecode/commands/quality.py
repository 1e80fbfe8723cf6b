"""`specdecode quality`: what a quantized dtype costs in fidelity, against a reference dtype
of the same model, on a fixed text.

Both read the same chunks of Python standard-library source (teacher-forced, one pass per
chunk from an empty cache). At every position the next-token distributions are compared:
mean and largest KL(reference ‖ quantized), how often the two argmaxes agree, the mean and
largest absolute logit difference, and each one's perplexity on the text. Speculative
decoding keeps whatever model it is given exactly; this measures how far the quantized
model itself is from the float one.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdecode.errors import SpecDecodeError
from specdecode.heads.training.corpus import stdlib_documents
from specdecode.models.load import load


@torch.inference_mode()
def compare(reference, candidate, chunks: Sequence[Sequence[int]]) -> dict:
    """The figures above for two models over token chunks (each at least two tokens)."""
    kl_sum = agree = positions = 0
    kl_max = diff_max = diff_sum = 0.0
    nll = {"reference": 0.0, "candidate": 0.0}
    for chunk in chunks:
        ids = torch.tensor([list(chunk)])
        logits = {}
        for name, model in (("reference", reference), ("candidate", candidate)):
            logits[name] = model(ids, model.new_cache(1, len(chunk) + 1)).logits[0, :-1].float()
        ref, cand = logits["reference"], logits["candidate"]
        ref_log, cand_log = F.log_softmax(ref, -1), F.log_softmax(cand, -1)
        kl = (ref_log.exp() * (ref_log - cand_log)).sum(-1)
        targets = ids[0, 1:]
        for name, log_probs in (("reference", ref_log), ("candidate", cand_log)):
            nll[name] -= float(log_probs.gather(1, targets[:, None]).sum())
        diff = (ref - cand).abs()
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        diff_sum += float(diff.mean(-1).sum())
        diff_max = max(diff_max, float(diff.max()))
        positions += len(chunk) - 1
    if positions == 0:
        raise SpecDecodeError("quality needs chunks of at least two tokens")
    return {"positions": positions, "mean_kl": kl_sum / positions, "max_kl": kl_max,
            "top1_agreement": agree / positions, "mean_abs_logit_diff": diff_sum / positions,
            "max_abs_logit_diff": diff_max,
            "reference_perplexity": math.exp(nll["reference"] / positions),
            "candidate_perplexity": math.exp(nll["candidate"] / positions)}


def run_quality(target: str, dtype: str = "gguf", reference: str = "bf16", tokens: int = 2048, chunk: int = 512,
                log=print) -> dict:
    if tokens < 2 or chunk < 2:
        raise SpecDecodeError(f"quality needs --tokens and --chunk of at least 2, got {tokens} and {chunk}")
    log(f"loading {target} as {reference} and as {dtype}")
    ref_model, tokenizer, _ = load(target, reference, backend="native")
    cand_model, _, _ = load(target, dtype, backend="native")
    chunks = stdlib_documents(tokenizer, tokens, chunk)
    log(f"comparing over {sum(len(c) for c in chunks)} tokens of standard-library source")
    figures = compare(ref_model, cand_model, chunks)
    return {"target": target, "dtype": dtype, "reference": reference, **figures,
            "machine": platform.processor() or platform.machine()}


def format_quality(r: dict) -> str:
    return "\n".join([
        f"target {r['target']}: {r['dtype']} against {r['reference']}, {r['positions']} positions of "
        "standard-library source",
        f"  KL({r['reference']} ‖ {r['dtype']})  mean {r['mean_kl']:.4f} nats, largest {r['max_kl']:.3f}",
        f"  same top token      {100 * r['top1_agreement']:.2f}% of positions",
        f"  logit difference    mean {r['mean_abs_logit_diff']:.3f}, largest {r['max_abs_logit_diff']:.2f}",
        f"  perplexity          {r['reference']} {r['reference_perplexity']:.3f}, "
        f"{r['dtype']} {r['candidate_perplexity']:.3f}",
    ])
