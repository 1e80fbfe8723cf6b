"""The bench end to end on SmolLM2 with prompt lookup, tiny budget: rows, checks and files."""

import json

import pytest

from specdecode.bench import run_bench
from specdecode.report import write_report
from specdecode.suites import Question


@pytest.mark.real
def test_bench_writes_rows_report_and_plots(tmp_path):
    questions = [
        Question("1", "code-edit", ("Add type hints: def area(width, height):\n    return width * height",)),
        Question("2", "chat", ("Name a colour.", "Now name another one.")),  # multi-turn
    ]
    result = run_bench(questions, "smollm2-135m-instruct", None, ("prompt-lookup",), lookup_k=3,
                       max_new_tokens=8, repeats=1, peers=False, log=lambda _: None)
    assert result["prompts"] == 3  # the second question's two turns are two prompts
    rows = {(r["category"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(c, m) for c in ("code-edit", "chat") for m in ("plain", "prompt-lookup")}
    for row in result["rows"]:
        assert row["identical_to_plain"] is True
        assert row["speedup"] > 0 and row["tokens_per_s"] > 0
        assert {"acceptance_rate", "mean_accepted_length", "acceptance_by_position", "time_split"} <= set(row)
    assert rows["chat", "plain"]["speedup"] == pytest.approx(1.0)
    assert result["target_sha256"] and result["target_bytes"] > 0

    paths = write_report(result, tmp_path)
    assert {p.name for p in paths} == {"results.json", "report.md", "speedup.png", "acceptance_by_position.png",
                                       "time_split.png"}
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == result["rows"]
    assert "| code-edit | prompt-lookup k=3 |" in (tmp_path / "report.md").read_text()
