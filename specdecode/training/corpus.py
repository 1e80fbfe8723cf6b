"""Training text for drafter heads: real text, and the target's own answers.

Heads learn what the target would say (self-distillation), so every text is run through
the frozen target and labelled with its own next-token predictions (features.py). Two
sources:
- the Python standard library's source files: real code, cheap to run teacher-forced;
- the target's answers to instructions like the task suites' but not the suites' own
  (HumanEval problems the code-completion suite skips, edits of standard-library
  functions the code-edit suite does not quote, questions written for training), so that
  `bench` stays held out. An answer is exactly what the target says, so its labels are
  exact; generating is slow on this CPU, so there are few of them.
"""

from __future__ import annotations

import importlib
import inspect
import sysconfig
import textwrap
from pathlib import Path

from ..suites import (CODE_EDIT_TEMPLATE, CODE_EDITS, HUMANEVAL_STRIDE, HUMANEVAL_TEMPLATE, MATH_TEMPLATE,
                      SUMMARY_MODULES, SUMMARY_TEMPLATE, TRANSLATION_TEMPLATE, _humaneval_problems,
                      module_docstring, truncate_words)

# Modules the suites quote (code-edit functions, summarized docs): never trained on.
HELD_OUT_MODULES = frozenset({d.split(".")[0] for d, _ in CODE_EDITS} | {m.split(".")[0] for m in SUMMARY_MODULES})

TRAIN_EDIT_FUNCTIONS = ("shlex.quote", "string.capwords", "posixpath.relpath", "base64.b16decode",
                        "calendar.isleap", "colorsys.rgb_to_hsv", "difflib.get_close_matches",
                        "keyword.iskeyword", "ipaddress.ip_address", "bisect.insort_right")
TRAIN_EDITS = ("Add type hints and a docstring. Return the complete function.",
               "Rename the local variables to more descriptive names. Return the complete function.",
               "Add a comment above each step explaining it. Return the complete function.")
TRAIN_CHAT = (
    "Explain what a hash table is and why lookups are fast on average.",
    "What is the difference between a list and a tuple in Python?",
    "How do I choose between REST and GraphQL for a new web API?",
    "Explain recursion to a beginner, with a small example.",
    "What does a load balancer do?",
    "Give me tips for writing clear commit messages.",
    "Why do people say premature optimization is the root of all evil?",
    "What is the difference between unit tests and integration tests?",
    "How can I stay focused when working from home?",
    "Explain how a refrigerator keeps food cold.",
    "What are the main causes of inflation?",
    "Describe the water cycle in a few sentences.",
)
TRAIN_MATH = (
    "A shop sells apples at 3 for $2. How much do 18 apples cost?",
    "A train travels 240 km in 3 hours. At the same speed, how far does it go in 5 hours?",
    "Tom has twice as many marbles as Sam. Together they have 36. How many does Tom have?",
    "A rectangle is 8 cm long and its area is 56 square cm. What is its perimeter?",
    "A book costs $15 after a 25% discount. What was the original price?",
    "If 5 workers build a wall in 12 days, how many days do 6 workers need?",
)
TRAIN_TRANSLATION = (
    ("English", "French", "The library opens at nine and closes at six on weekdays."),
    ("English", "German", "I would like to book a table for four people tonight at eight."),
    ("English", "Spanish", "Please remember to water the plants while I am away."),
    ("French", "English", "Il fait très beau aujourd'hui, allons nous promener au parc."),
    ("German", "English", "Ich habe meinen Schlüssel im Büro vergessen."),
    ("Spanish", "English", "¿Dónde está la estación de autobuses más cercana?"),
)
TRAIN_SUMMARY_MODULES = ("json", "csv", "logging", "pathlib", "functools", "itertools")


def instruction_prompts() -> list[str]:
    """Prompts in the suites' styles, none of them a suite's own, the kinds interleaved so
    that the first few already cover every kind."""
    code = [HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])
            for p in _humaneval_problems()[HUMANEVAL_STRIDE // 2::HUMANEVAL_STRIDE]]
    edits = []
    for i, dotted in enumerate(TRAIN_EDIT_FUNCTIONS):
        module, name = dotted.rsplit(".", 1)
        try:
            source = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), name)))
        except (ImportError, AttributeError, OSError, TypeError):
            continue
        edits.append(CODE_EDIT_TEMPLATE.format(instruction=TRAIN_EDITS[i % len(TRAIN_EDITS)], source=source))
    maths = [MATH_TEMPLATE.format(problem=p) for p in TRAIN_MATH]
    translations = [TRANSLATION_TEMPLATE.format(source=s, target=t, text=x) for s, t, x in TRAIN_TRANSLATION]
    summaries = [SUMMARY_TEMPLATE.format(module=m, text=truncate_words(doc))
                 for m in TRAIN_SUMMARY_MODULES if (doc := module_docstring(m))]
    kinds = [code, edits, list(TRAIN_CHAT), maths, translations, summaries]
    return [kind[i] for i in range(max(map(len, kinds))) for kind in kinds if i < len(kind)]


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules, in a fixed order, minus the held-out ones."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.glob("*.py")) if p.stem not in HELD_OUT_MODULES and not p.stem.startswith("_")]


def stdlib_documents(tokenizer, max_tokens: int, chunk: int) -> list[list[int]]:
    """Token chunks of standard-library source, max_tokens in all."""
    documents, total = [], 0
    for path in stdlib_files():
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk][: max_tokens - total]
            if len(piece) > 8:
                documents.append(piece)
                total += len(piece)
            if total >= max_tokens:
                return documents
    return documents
