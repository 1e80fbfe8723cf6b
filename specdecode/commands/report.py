"""Turn a bench result (bench.py) into `report.md` and PNG plots.

Plots: speedup over our plain decoding by category and method, the peers beside ours;
acceptance by draft position; the time split (prefill, drafting, verification, the rest)
of our methods. matplotlib draws off-screen (Agg), so no display is needed.
"""

from __future__ import annotations

import json
from pathlib import Path


def method_label(row: dict) -> str:
    ours = "acceptance_rate" in row  # our methods; the peers report no acceptance
    return f"{row['method']} k={row['k']}" if ours and row["k"] is not None else row["method"]


def table(result: dict) -> str:
    lines = [
        f"target {result['target']}, draft {result['draft']}, {result['dtype']}, temperature {result['temperature']}, "
        f"{result['max_new_tokens']} new tokens, {result['prompts']} prompts, median of {result['repeats']}, "
        f"{result['threads']} threads", "",
        "| category | method | tok/s | speedup | first token s | theory E(α) | bound τ | α | τ | identical |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def fmt(key, spec, suffix=""):
            return f"{r[key]:{spec}}{suffix}" if r.get(key) is not None else ""
        same = {True: "yes", False: "NO", None: "n/a"}[r["identical_to_plain"]]
        if result["temperature"] > 0 and same != "n/a":
            same = "(sampled)"
        lines.append(f"| {r['category']} | {method_label(r)} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x "
                     f"| {fmt('time_to_first_token_s', '.2f')} | {fmt('theoretical_speedup', '.2f', 'x')} | {fmt('bound_speedup', '.2f', 'x')} "
                     f"| {fmt('acceptance_rate', '.2f') if r['method'] != 'plain' else ''} "
                     f"| {fmt('mean_accepted_length', '.2f')} | {same} |")
    return "\n".join(lines)


def verdict(result: dict, method: str = "tuned") -> list[dict]:
    """Per category, how `method` fares: its speedup over our plain decoding, the best
    transformers peer's, and its measured speedup over the theoretical one (E(α) from the
    measured α, k, draft and verify costs). Empty when the bench did not run it."""
    rows = result["rows"]
    out = []
    for category in dict.fromkeys(r["category"] for r in rows):
        ours = next((r for r in rows if r["category"] == category and r["method"] == method), None)
        if ours is None:
            continue
        peers = [r for r in rows if r["category"] == category and r["method"].startswith("transformers")]
        best = max(peers, key=lambda r: r["speedup"], default=None)
        theory = ours.get("theoretical_speedup")
        out.append({"category": category, "speedup": ours["speedup"],
                    "best_peer": best["method"] if best else None, "best_peer_speedup": best["speedup"] if best else None,
                    "over_best_peer": ours["speedup"] / best["speedup"] if best else None,
                    "over_theory": ours["speedup"] / theory if theory else None})
    return out


def verdict_table(result: dict, method: str = "tuned") -> str:
    found = verdict(result, method)
    if not found:
        return ""
    lines = [f"{method} against the best transformers peer, our plain decoding (1.00x) and the theory:", "",
             f"| category | {method} | best peer | {method} / best peer | measured / theory E(α) |",
             "|---|---|---|---|---|"]
    for v in found:
        peer = f"{v['best_peer_speedup']:.2f}x ({v['best_peer'].removeprefix('transformers ')})" if v["best_peer"] else ""
        ratio = f"{v['over_best_peer']:.2f}" if v["over_best_peer"] is not None else ""
        theory = f"{v['over_theory']:.2f}" if v["over_theory"] is not None else ""
        lines.append(f"| {v['category']} | {v['speedup']:.2f}x | {peer} | {ratio} | {theory} |")
    return "\n".join(lines)


def plots(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(method_label(r) for r in rows if r["method"] != "plain"))
    paths = []

    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(categories)), 4.5))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        values = [next((r["speedup"] for r in rows if r["category"] == c and method_label(r) == m), 0) for c in categories]
        ax.bar([j + i * width for j in range(len(categories))], values, width, label=m,
               hatch="//" if m.startswith("transformers") else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories)
    ax.set_ylabel("speedup over our plain decoding")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{result['target']}: speedup by category")
    paths.append(_save(fig, out_dir / "speedup.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        for c in categories:
            r = next((r for r in rows if r["category"] == c and method_label(r) == m), None)
            if r and r.get("acceptance_by_position"):
                ax.plot(range(1, len(r["acceptance_by_position"]) + 1), r["acceptance_by_position"], marker="o",
                        label=f"{m}, {c}", linewidth=1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("acceptance by draft position")
    paths.append(_save(fig, out_dir / "acceptance_by_position.png"))

    ours = [r for r in rows if r.get("time_split")]
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(ours)), 4.5))
    bottom = [0.0] * len(ours)
    for part in ("prefill", "draft", "verify", "other"):
        values = [r["time_split"][part] / max(1e-9, sum(r["time_split"].values())) for r in ours]
        ax.bar(range(len(ours)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(ours)), [f"{r['category']}\n{method_label(r)}" for r in ours], rotation=90, fontsize=6)
    ax.set_ylabel("share of time")
    ax.legend(fontsize=7)
    ax.set_title("time split")
    paths.append(_save(fig, out_dir / "time_split.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(result: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md and the plots, each written whole (temporary name, then rename)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    report = table(result) + "\n" + ("\n" + verdict_table(result) + "\n" if verdict(result) else "")
    for name, text in (("results.json", json.dumps(result, indent=1)), ("report.md", report)):
        partial = out_dir / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out_dir / name)
        written.append(out_dir / name)
    return written + plots(result, out_dir)
