"""Training text for drafter heads: the standard library's source.

Heads learn what the target would say (self-distillation), so every text is run through
the frozen target and labelled with its own next-token predictions (features.py). The
Python standard library's source files are real code, cheap to run teacher-forced; the
modules the suites quote are left out, so `bench` stays held out. The other source, the
target's own answers to instructions (instructions.py, batch_greedy.py), has labels that
agree with the text along the whole answer.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from specdecode.suites import CODE_EDITS, SUMMARY_MODULES

# Modules the suites quote (code-edit functions, summarized docs): never trained on.
HELD_OUT_MODULES = frozenset({d.split(".")[0] for d, _ in CODE_EDITS} | {m.split(".")[0] for m in SUMMARY_MODULES})


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules, in a fixed order, minus the held-out ones."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.glob("*.py")) if p.stem not in HELD_OUT_MODULES and not p.stem.startswith("_")]


def stdlib_documents(tokenizer, max_tokens: int, chunk: int) -> list[list[int]]:
    """Token chunks of standard-library source, max_tokens in all."""
    return [ids for ids, _ in stdlib_chunks(tokenizer, max_tokens, chunk)]


def stdlib_chunks(tokenizer, max_tokens: int, chunk: int) -> list[tuple[list[int], str]]:
    """(token chunk, its source `stdlib/MODULE`) of standard-library source, max_tokens in all."""
    chunks, total = [], 0
    for path in stdlib_files():
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk][: max_tokens - total]
            if len(piece) > 8:
                chunks.append((piece, f"stdlib/{path.stem}"))
                total += len(piece)
            if total >= max_tokens:
                return chunks
    return chunks
