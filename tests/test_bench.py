"""The bench end to end on SmolLM2 with prompt lookup, tiny budget: rows, checks and files."""

import json

import pytest

from specdecode.commands.bench import run_bench
from specdecode.commands.report import write_report
from specdecode.questions import Question
from specdecode.policy.profile import Profile


@pytest.mark.real
def test_bench_writes_rows_report_and_plots(tmp_path):
    questions = [
        Question("1", "code-edit", ("Add type hints: def area(width, height):\n    return width * height",)),
        Question("2", "chat", ("Name a colour.", "Now name another one.")),  # multi-turn
    ]
    # a profile that picks the draft model (here the target itself) for chat, lookup for edits
    profile = Profile("smollm2-135m-instruct", "bfloat16", {1: 0.02, 4: 0.021, 8: 0.022},
                      {"draft-model": {"draft": "smollm2-135m-instruct", "step_s": 0.01},
                       "prompt-lookup": {"draft": None, "step_s": 0.0}})
    profile.decide("chat", {"draft-model": 0.9, "prompt-lookup": 0.1})
    profile.decide("code-edit", {"draft-model": 0.5, "prompt-lookup": 0.7})
    result = run_bench(questions, "smollm2-135m-instruct", "smollm2-135m-instruct",
                       ("prompt-lookup", "tuned", "medusa", "draft-tree"), lookup_k=3, max_new_tokens=8, repeats=1,
                       peers=False, profile=profile, log=lambda _: None, tree_widths=((2, 1),), llama_cpp=False)
    assert result["prompts"] == 3  # the second question's two turns are two prompts
    rows = {(r["category"], r["method"]): r for r in result["rows"]}
    methods = ("plain", "prompt-lookup", "tuned", "medusa", "draft-tree 2x1")
    assert set(rows) == {(c, m) for c in ("code-edit", "chat") for m in methods}
    # the draft model (the target itself) drafts at a cost; prompt lookup almost for free
    assert rows["chat", "tuned"]["time_split"]["draft"] > 10 * rows["code-edit", "tuned"]["time_split"]["draft"]
    for row in result["rows"]:
        assert row["identical_to_plain"] is True
        assert row["speedup"] > 0 and row["tokens_per_s"] > 0 and row["time_to_first_token_s"] > 0
        assert {"acceptance_rate", "mean_accepted_length", "acceptance_by_position", "time_split"} <= set(row)
    assert rows["chat", "plain"]["speedup"] == pytest.approx(1.0)
    assert result["target_sha256"] and result["target_bytes"] > 0

    paths = write_report(result, tmp_path)
    assert {p.name for p in paths} == {"results.json", "report.md", "speedup.png", "acceptance_by_position.png",
                                       "time_split.png"}
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == result["rows"]
    assert "| code-edit | prompt-lookup k=3 |" in (tmp_path / "report.md").read_text()


@pytest.mark.real
def test_sampled_bench_runs_the_peers_sampling_too():
    questions = [Question("1", "code-edit", ("Add type hints: def area(width, height):\n    return width * height",))]
    result = run_bench(questions, "smollm2-135m-instruct", None, ("prompt-lookup",), lookup_k=3, max_new_tokens=8,
                       repeats=1, temperature=0.7, seed=1, peers=True, log=lambda _: None)
    rows = {r["method"]: r for r in result["rows"]}
    assert {"plain", "prompt-lookup", "transformers plain", "transformers prompt-lookup"} <= set(rows)
    assert result["temperature"] == 0.7
    # sampled runs draw other random numbers than plain decoding: identity is not asked of them
    assert all(r["identical_to_plain"] is None for r in result["rows"])
    assert rows["prompt-lookup"]["acceptance_rate"] is not None and rows["transformers plain"]["speedup"] > 0
    assert all(r["time_to_first_token_s"] > 0 for r in result["rows"])  # the peers' first tokens too


def test_verdict_compares_tuned_with_the_best_peer_and_the_theory():
    from specdecode.commands.report import verdict, verdict_table

    rows = [
        {"category": "chat", "method": "plain", "k": None, "speedup": 1.0},
        {"category": "chat", "method": "tuned", "k": None, "speedup": 1.5, "theoretical_speedup": 1.2},
        {"category": "chat", "method": "transformers plain", "k": None, "speedup": 0.75},
        {"category": "chat", "method": "transformers assisted", "k": None, "speedup": 1.2},
        {"category": "math", "method": "plain", "k": None, "speedup": 1.0},
        {"category": "math", "method": "prompt-lookup", "k": 4, "speedup": 1.1},
    ]
    (chat,) = verdict({"rows": rows})
    assert chat["best_peer"] == "transformers assisted" and chat["over_best_peer"] == pytest.approx(1.25)
    assert chat["over_theory"] == pytest.approx(1.25)
    assert "| chat | 1.50x | 1.20x (assisted) | 1.25 | 1.25 |" in verdict_table({"rows": rows})
    assert verdict({"rows": rows[4:]}) == [] and verdict_table({"rows": rows[4:]}) == ""
