"""`specdecode check`'s report as text: one line of verdict (`summary`), and the whole
report per prompt and position (`format_check`), from the dict `run_check` returns."""

from __future__ import annotations


def summary(result: dict) -> str:
    """One line: PASS or FAIL and why."""
    greedy = result["greedy"]
    differ = [c for c in greedy if not c["identical"]]
    parts = []
    if differ:
        where = ", ".join(f"{c['prompt']} at token {c['first_mismatch']}" for c in differ)
        parts.append(f"greedy output differs on {len(differ)}/{len(greedy)} prompts ({where})")
    else:
        parts.append(f"greedy output identical on {len(greedy)}/{len(greedy)} prompts")
    tests = result["sampled"]
    threshold = result["bonferroni_threshold"]
    if tests:
        smallest = min(t["p_value"] for t in tests)
        failed = sum(t["failed"] for t in tests)
        parts.append(f"sampled: {failed} of {len(tests)} position tests below p {threshold:.2g} "
                     f"(alpha {result['alpha']:g} / {len(tests)}; smallest p {smallest:.2g})")
        single = sum(t["bins"] == 1 for t in tests)
        if single:
            parts.append(f"{single} of {len(tests)} positions left one bin after pooling (nearly always one "
                         "token) and were not tested; more --samples test them")
    else:
        parts.append("sampled check skipped (temperature 0)")
    return ("PASS: " if result["passed"] else "FAIL: ") + "; ".join(parts)


def _label(case: dict) -> str:
    """The prompt's name: its id, after its category unless the id starts with it."""
    prompt, category = case["prompt"], case["category"]
    return prompt if prompt.startswith(category) else f"{category}/{prompt}"


def format_check(result: dict) -> str:
    c = result["config"]
    lines = [f"target {c['target']} ({c['dtype']}), drafter {c['drafter']}, k {c['k']}"]
    lines.append(f"greedy, {c['greedy_tokens']} tokens per prompt:")
    for case in result["greedy"]:
        head = f"  {_label(case):<28}"
        drafting = f"{case['drafted']} drafted, {case['accepted']} accepted"
        if case["identical"]:
            lines.append(f"{head} identical ({case['plain_tokens']} tokens; {drafting})")
        else:
            lines.append(f"{head} DIFFERS at token {case['first_mismatch']}: plain {case['plain_token']} "
                         f"{case['plain_text']!r}, speculative {case['speculative_token']} "
                         f"{case['speculative_text']!r}; target's top-2 logit margin there "
                         f"{case['margin']:.3g} ({drafting})")
    if result["sampled"]:
        lines.append(f"sampled, temperature {c['temperature']:g}, top-k {c['top_k']}, top-p {c['top_p']:g}: "
                     f"{c['samples']} runs per arm; fail below p {result['bonferroni_threshold']:.3g}")
        lines.append(f"  {'prompt':<28} {'pos':>3} {'p-value':>9} {'TV':>6} {'tokens':>6} {'bins':>4}")
        for t in result["sampled"]:
            mark = "  FAIL" if t["failed"] else "  (one bin: not tested)" if t["bins"] == 1 else ""
            lines.append(f"  {_label(t):<28} {t['position']:>3} {t['p_value']:>9.3g} "
                         f"{t['tv_distance']:>6.3f} {t['categories']:>6} {t['bins']:>4}{mark}")
        for d in result["sampled_drafting"]:
            rate = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
            note = "" if d["drafted"] else "  (nothing drafted: this prompt tested no acceptance)"
            lines.append(f"  {_label(d):<28} speculative runs: {d['drafted']} drafted, "
                         f"{d['accepted']} accepted (α {rate:.2f}){note}")
    s = result["seconds"]
    lines.append(f"[{s['total']:.0f} s: load {s['load']:.0f}, greedy {s['greedy']:.0f}, sampled {s['sampled']:.0f}]")
    lines.append(result["summary"])
    return "\n".join(lines)
