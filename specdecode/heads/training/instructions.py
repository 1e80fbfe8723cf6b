"""Instructions for the target to answer: many, varied, in the suites' styles, none a suite's.

The heads train best on the target's own answers (batch_greedy.py), so training needs
prompts by the thousand, built here from material every Python install has:
- code completion: the HumanEval problems the code-completion suite skips, then
  standard-library functions cut after their docstring, in HumanEval's form;
- code edits and explanations of standard-library functions;
- summaries of module docstrings; translations of docstring sentences;
- chat: questions from templates and the language reference's topic names;
- math: word problems from templates with seeded random numbers.
The standard library is read with `ast`, never imported (importing `antigravity` opens a
browser), and the modules the suites quote are left out, so `bench` stays held out.
Each kind is shuffled with a fixed seed, and the kinds are interleaved (code three times
as often as each other kind) so that any prefix of the list covers every kind.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap

from specdecode.suites import (CODE_EDIT_TEMPLATE, HUMANEVAL_STRIDE, HUMANEVAL_TEMPLATE, MATH_TEMPLATE, SUMMARY_TEMPLATE,
                      TRANSLATION_TEMPLATE, _humaneval_problems, truncate_words)
from specdecode.heads.training.corpus import stdlib_files

MAX_FUNCTION_LINES = 40
CODE_WEIGHT = 3  # code prompts per prompt of each other kind

EDIT_INSTRUCTIONS = (
    "Add type hints and a docstring. Return the complete function.",
    "Rename the local variables to more descriptive names. Return the complete function.",
    "Add a comment above each step explaining it. Return the complete function.",
    "Add type hints to the signature. Change nothing else and return the complete function.",
    "Rewrite the function to be easier to read, keeping its behaviour. Return the complete function.",
    "Add input validation that raises a ValueError with a clear message. Return the complete function.",
)
EXPLAIN = "Explain what this Python function does, step by step.\n\n```python\n{source}```"
TESTS = "Write pytest unit tests for this function.\n\n```python\n{source}```"
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese")

CHAT_TEMPLATES = (
    "Explain {topic} in Python, with a short example.",
    "What are common mistakes beginners make with {topic} in Python?",
)
CHAT_SUBJECTS = (
    "a binary search tree", "a message queue", "database indexing", "garbage collection", "TCP and UDP",
    "public-key cryptography", "a content delivery network", "containers and virtual machines",
    "functional programming", "test-driven development", "continuous integration", "a REST API",
    "memoization", "the CAP theorem", "eventual consistency", "a compiler and an interpreter",
    "regular expressions", "unicode and UTF-8", "a linked list", "dynamic programming", "code review",
    "technical debt", "pair programming", "semantic versioning", "a mutex", "deadlocks", "caching",
    "photosynthesis", "the greenhouse effect", "interest rates", "a healthy morning routine",
    "learning a new language as an adult", "time management", "the immune system", "plate tectonics",
    "how airplanes fly", "the stock market", "electric cars", "meditation", "public speaking",
)
CHAT_QUESTIONS = (
    "What is {subject}? Explain it simply.",
    "What are the pros and cons of {subject}?",
    "Explain {subject} to a ten-year-old.",
)

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lea")
ITEMS = ("apples", "pens", "notebooks", "oranges", "stickers", "cookies", "bottles", "tickets")


def _math_problem(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(10, 90)
    templates = (
        f"A shop sells {item} at {a} for ${b}. How much do {a * c} {item} cost?",
        f"A train travels {a * c} km in {a} hours. At the same speed, how far does it go in {a + b} hours?",
        f"{name} has {a * b + c} {item}. {name} gives {b} to each of {a} friends. How many are left?",
        f"A rectangle is {b + c} cm long and {a + b} cm wide. What are its area and its perimeter?",
        f"A jacket costs ${c * 4}. It is discounted by {5 * a}%. What is the new price?",
        f"{name} saves ${b} each week and already has ${c}. After how many weeks will {name} have ${c + b * a * 3}?",
        f"A tank holds {c * 10} litres and fills at {a * 5} litres per minute. How many minutes does it take to fill?",
        f"{name} is {a + 20} years old, and her brother is {b} years younger. How old will he be in {c // 10} years?",
        f"There are {c} students and each bus holds {b + 10}. How many buses are needed?",
        f"A recipe needs {a} eggs for {b} cookies. How many eggs are needed for {b * c} cookies?",
    )
    return rng.choice(templates)


def _modules() -> list[tuple[str, ast.Module, list[str]]]:
    """(name, syntax tree, lines) of every usable standard-library module, parsed once."""
    parsed = []
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            parsed.append((path.stem, ast.parse(text), text.splitlines(keepends=True)))
        except SyntaxError:
            continue
    return parsed


def _functions(modules) -> list[tuple[str, ast.FunctionDef, list[str]]]:
    """(module, function node, the file's lines) of documented, not-too-long functions."""
    return [(name, node, lines) for name, tree, lines in modules for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node)
            and node.end_lineno - node.lineno < MAX_FUNCTION_LINES and not node.name.startswith("_")]


def _source(node: ast.FunctionDef, lines: list[str]) -> str:
    return textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))


def _stub(node: ast.FunctionDef, lines: list[str]) -> str:
    """The function up to the end of its docstring, as HumanEval gives a problem."""
    return textwrap.dedent("".join(lines[node.lineno - 1:node.body[0].end_lineno]))


def _sentences(doc: str) -> list[str]:
    """Plain prose sentences of a docstring (no code, no markup), 8 to 40 words."""
    parts = re.split(r"(?<=[.!?])\s+", " ".join(doc.split()))
    return [s for s in parts if 8 <= len(s.split()) <= 40 and not re.search(r"[>{}\[\]=_`|*]", s)]


def _interleave(kinds: list[list]) -> list:
    return [kind[i] for i in range(max(map(len, kinds))) for kind in kinds if i < len(kind)]


def instructions(seed: int = 0) -> list[tuple[str, str]]:
    """Every training instruction with its source, in a fixed order that mixes the kinds.

    The source names what a prompt is made from: the standard-library module of its
    function or docstring (`stdlib/NAME`, as the teacher-forced source of that module is
    named), the HumanEval problem, the chat topic, the maths problem. Prompts of one
    source share text, so a held-out split by source (training/medusa.py) keeps a module's
    functions, edited, explained or completed, on one side only."""
    rng = random.Random(seed)
    modules = _modules()
    functions = _functions(modules)
    rng.shuffle(functions)
    humaneval = [(HUMANEVAL_TEMPLATE.format(prompt=p["prompt"]), f"humaneval/{i}")
                 for i, p in enumerate(_humaneval_problems()) if i % HUMANEVAL_STRIDE]
    stubs = [(HUMANEVAL_TEMPLATE.format(prompt=_stub(node, lines)), f"stdlib/{name}") for name, node, lines in functions]
    code = _interleave([humaneval, stubs])
    edits = [(CODE_EDIT_TEMPLATE.format(instruction=EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)],
                                        source=_source(node, lines)), f"stdlib/{name}")
             for i, (name, node, lines) in enumerate(functions)]
    explain = [((EXPLAIN if i % 2 else TESTS).format(source=_source(node, lines)), f"stdlib/{name}")
               for i, (name, node, lines) in enumerate(reversed(functions))]

    summaries, sentences = [], []
    for name, tree, _ in modules:
        doc = ast.get_docstring(tree)
        if doc and len(doc.split()) >= 60:
            summaries.append((SUMMARY_TEMPLATE.format(module=name, text=truncate_words(doc)), f"stdlib/{name}"))
    for name, node, _ in functions:
        sentences += [(s, f"stdlib/{name}") for s in _sentences(ast.get_docstring(node))[:1]]
    translations = [(TRANSLATION_TEMPLATE.format(source="English", target=LANGUAGES[i % len(LANGUAGES)], text=s), src)
                    for i, (s, src) in enumerate(sentences)]

    from pydoc_data.topics import topics
    chat = [(template.format(topic=topic.replace("-", " ")), f"chat/{topic}")
            for topic in topics for template in CHAT_TEMPLATES]
    chat += [(q.format(subject=s), f"chat/{s}") for s in CHAT_SUBJECTS for q in CHAT_QUESTIONS]
    maths = [(MATH_TEMPLATE.format(problem=_math_problem(rng)), f"math/{i}") for i in range(len(code) // CODE_WEIGHT)]
    for kind in (edits, explain, summaries, translations, chat):
        rng.shuffle(kind)
    return _interleave([code[i::CODE_WEIGHT] for i in range(CODE_WEIGHT)]
                       + [edits, explain, chat, maths, translations, summaries])


def instruction_prompts(seed: int = 0) -> list[str]:
    """Every training instruction's text, in instructions()' order."""
    return [text for text, _ in instructions(seed)]
