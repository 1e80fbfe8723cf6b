"""What every head's training shares: the step loop, a resumable checkpoint, and the
reduced vocabulary of its loss."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from specdecode.models.kernels import cpu_flags, cpu_has_amx


class Checkpoint:
    """The module, optimizer, step and record, saved by rename; resumed only when the
    settings and the data are those it was saved with."""

    def __init__(self, path: Path, module: torch.nn.Module, optimizer, config, data):
        """data: what identifies the training set (its positions, the held-out ones)."""
        self.path, self.module, self.optimizer = path, module, optimizer
        self.key = {"config": dict(config.__dict__), "tokens": data}

    def resume(self) -> tuple[int, dict]:
        """(step, record) to continue from; (0, {}) when there is nothing to resume."""
        if not self.path.is_file():
            return 0, {}
        state = torch.load(self.path)
        if {"config": state["config"], "tokens": state["tokens"]} != self.key:
            return 0, {}
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        return state["step"], state["record"]

    def save(self, step: int, record: dict) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        torch.save({"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step,
                    "record": record, **self.key}, partial)
        partial.replace(self.path)


def bf16_is_fast() -> bool:
    """Whether torch's bf16 products beat fp32 here: on CPUs with bf16 instructions (AMX,
    AVX512-BF16) about 3x faster; without them (AVX2) 4.5x slower (AMD EPYC Zen 3:
    512x576 by 576x1536, 121 ms bf16 against 27 ms fp32)."""
    return cpu_has_amx() or "avx512_bf16" in cpu_flags()


def reduced_vocabulary(labels: torch.Tensor, lm_weight: torch.Tensor, dtype=torch.bfloat16):
    """(rows of the LM head for the tokens that occur among the labels, index: token -> row or -1).

    The softmax of a training loss runs over these rows only: the LM head product is most
    of a head's training cost on this CPU; in bf16 where that is fast (bf16_is_fast)."""
    vocab = torch.unique(labels)
    index = torch.full((lm_weight.shape[0],), -1, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    return lm_weight[vocab].to(dtype), index


def run_steps(loss_at: Callable[[int], torch.Tensor], module: torch.nn.Module, optimizer, checkpoint: Checkpoint,
              step: int, total: int, lr: float, record: dict, every: int, desc: str) -> None:
    """Adam steps from `step` to `total` with cosine-decayed lr, clipped gradients, a
    progress bar, and a checkpoint every `every` steps and at the end."""

    bar = tqdm(total=total, initial=step, desc=desc, unit="step")
    while step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
        loss = loss_at(step)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % every == 0 or step == total:
            checkpoint.save(step, record)
    bar.close()
