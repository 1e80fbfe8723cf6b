"""Benchmark questions: the `Question` every suite is made of, the question files of
Spec-Bench and MT-bench, and the conversations of multi-turn questions.

`load_prompt_file(path)` reads the question format of Spec-Bench and MT-bench (JSONL:
`question_id`, `category`, `turns`), so their question sets can be run as they are;
`conversation(question, answers)` builds the messages of the next turn the way MT-bench
does, with the model's own earlier answers in between. Spec-Bench's own data is not
shipped here: point `load_prompt_file` at its `question.jsonl`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class Question:
    """One benchmark question: one or more user turns (several for a multi-turn question)."""

    question_id: str
    category: str
    turns: tuple[str, ...]


def load_prompt_file(path) -> list[Question]:
    """Questions from a Spec-Bench / MT-bench JSONL file: one object per line with
    `question_id` (string or integer), `category` and `turns` (non-empty list of strings).
    Blank lines are skipped and other fields (such as `reference`) ignored."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecDecodeError(f"cannot read the prompt file {path}: {e}") from None
    questions, seen = [], {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise SpecDecodeError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for field in ("question_id", "category", "turns"):
            if field not in obj:
                raise SpecDecodeError(f"{where}: missing field {field!r}")
        qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
        if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
            raise SpecDecodeError(f"{where}: question_id must be a non-empty string or an integer, got {qid!r}")
        if not isinstance(category, str) or not category.strip():
            raise SpecDecodeError(f"{where}: category must be a non-empty string, got {category!r}")
        if not isinstance(turns, list) or not turns:
            raise SpecDecodeError(f"{where}: turns must be a non-empty list of strings")
        for i, turn in enumerate(turns, 1):
            if not isinstance(turn, str):
                raise SpecDecodeError(f"{where}: turn {i} is not a string ({type(turn).__name__})")
            if not turn.strip():
                raise SpecDecodeError(f"{where}: turn {i} is empty")
        qid = str(qid)
        if qid in seen:
            raise SpecDecodeError(f"{where}: question_id {qid!r} already used on line {seen[qid]}")
        seen[qid] = number
        questions.append(Question(qid, category, tuple(turns)))
    if not questions:
        raise SpecDecodeError(f"the prompt file {path} holds no questions")
    return questions


def conversation(question: Question, answers: list[str]) -> list[dict]:
    """Chat messages for the next turn, as MT-bench builds them: user turn 1, the model's
    answer 1, user turn 2, ..., ending with user turn len(answers) + 1."""
    answers = list(answers)
    if len(answers) >= len(question.turns):
        raise SpecDecodeError(f"question {question.question_id} has {len(question.turns)} turn(s); "
                              f"{len(answers)} answers leave no turn to ask")
    messages = []
    for turn, answer in zip(question.turns, answers):
        if not isinstance(answer, str):
            raise SpecDecodeError(f"answers must be strings, got {type(answer).__name__}")
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": question.turns[len(answers)]})
    return messages
