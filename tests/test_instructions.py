"""Training instructions: thousands, every kind early in the list, fixed order, and none
of the text the bench's suites ask about (the suites stay held out)."""

import pytest

from specdecode.suites import SUITES, load_suite
from specdecode.heads.training.instructions import instruction_prompts, instructions

MARKERS = {  # a phrase each kind's prompts start with
    "code": "Complete the following Python function.",
    "edit": "Return the complete function.",
    "explain": "this function",
    "math": "Solve this problem step by step",
    "translation": "Translate the following text",
    "summary": "Summarize it in 2-3 sentences.",
}


@pytest.fixture(scope="module")
def prompts():
    return instruction_prompts()


@pytest.mark.slow
def test_many_prompts_every_kind_early_fixed_order(prompts):
    assert len(prompts) > 3000
    assert prompts == instruction_prompts()
    assert len(set(prompts)) > 0.95 * len(prompts)
    first = prompts[:60]
    for kind, marker in MARKERS.items():
        assert any(marker in p for p in first), kind
    chat = [p for p in first if not any(m in p for m in MARKERS.values())]
    assert chat, "chat questions"
    assert sum(MARKERS["code"] in p for p in prompts[:90]) >= 25  # code three times as often as each other kind


@pytest.mark.slow
def test_prompts_name_their_source():
    pairs = instructions()
    assert [text for text, _ in pairs] == instruction_prompts()
    kinds = {source.split("/")[0] for _, source in pairs}
    assert kinds == {"stdlib", "humaneval", "chat", "math"}
    # a function's completion, edit and explanation share its module's source
    by_source = {}
    for text, source in pairs:
        by_source.setdefault(source, []).append(text)
    stdlib = [texts for source, texts in by_source.items() if source.startswith("stdlib/")]
    assert any(any(MARKERS["code"] in t for t in texts) and any(MARKERS["edit"] in t for t in texts)
               for texts in stdlib)


def test_no_suite_text_in_training(prompts):
    corpus = "\n".join(prompts)
    for suite in SUITES:
        for question in load_suite(suite):
            assert question.turns[0] not in prompts, question.question_id
            quoted = question.turns[0].split("```python\n")[-1][:200] if "```" in question.turns[0] else None
            if quoted:  # the code a code suite quotes appears nowhere in training prompts
                assert quoted not in corpus, question.question_id
