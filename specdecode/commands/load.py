"""`specdecode load`: a load generator for any OpenAI-compatible server.

At each concurrency level it sends `--requests` chat (or plain) completion requests to
`--url` with exactly that many in flight, once per speculation mode, and reports per
(mode, level): completion tokens/s, requests/s, time to first token and inter-token
latency (p50/p99), the acceptance rate the server reports, errors and client disconnects;
then each mode's throughput relative to `off`.

A mode becomes the request body field `speculative`: off -> false, auto -> no field (the
server decides), on -> the integer `--k`. Servers other than specdecode's (llama.cpp,
vLLM) know no such field: run them with `--speculative auto`. specdecode's server adds a
`speculation` object (drafted, accepted, acceptance_rate, mean_accepted_length) to each
response and final stream chunk; other servers' responses simply have none.

Where the server publishes specdecode's metrics (`/metrics` beside `/v1`), the report also
gives the sequences still running once each level is over (a client that went away must
leave none behind) and the server's resident memory before the first level and after
each: `--concurrency 16,16 --requests 500 --disconnect 0.1` is then a soak test, the first
level bringing the server to its full batch and the second showing whether it keeps growing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.questions import load_prompt_file
from specdecode.suites import load_suite

MODES = ("auto", "off", "on")
RUNNING = "specdecode:num_requests_running"
RESIDENT = "process_resident_memory_bytes"
SETTLE_S = 10.0  # how long a level's last sequences get to leave the batch before it counts them
DISCONNECT_AFTER = 3  # content chunks a disconnecting client reads before it closes the stream
HEADER = ("mode", "concurrency", "tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
          "α", "errors", "disconnected")
KEYS = ("mode", "concurrency", "tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
        "acceptance_rate", "errors", "disconnected")


def _levels(text: str) -> list[int]:
    parts = text.split(",")
    if not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"concurrency levels are integers >= 1 like 1,2,4,8, got {text!r}")
    return [int(part) for part in parts]


def _modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",")]
    if not all(mode in MODES for mode in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"modes are distinct ones of {', '.join(MODES)}, got {text!r}")
    return modes


def add_parser(sub) -> argparse.ArgumentParser:
    """Registers `load` on an argparse subparsers object."""
    p = sub.add_parser("load", help="load-test an OpenAI-compatible server: throughput and latency per concurrency")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL (default: http://127.0.0.1:8000/v1)")
    p.add_argument("--model", help="model id (default: the first one the server lists at /models)")
    p.add_argument("--api-key", help="API key (default: $OPENAI_API_KEY, else 'none')")
    p.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8],
                   help="levels of requests in flight (default: 1,2,4,8)")
    p.add_argument("--requests", type=int, default=32, help="requests per mode and level (default: 32)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default: 128)")
    p.add_argument("--prompts", default="chat", help="suite name(s), comma-separated, or a JSONL file with a "
                   "'prompt' or 'turns' field per line (default: chat)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="chat completions (default) or plain completions")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="whole responses instead of streams")
    p.add_argument("--disconnect", type=float, default=0.0, help="share of streamed requests whose client closes the "
                   f"stream after {DISCONNECT_AFTER} chunks (default: 0, none; a soak test sets it)")
    p.add_argument("--speculative", type=_modes, default=["auto", "off"], help="modes run side by side: auto (no "
                   "field), off (false), on (--k); other servers: auto only (default: auto,off)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round of mode on (default: 4)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default: 300)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the settings and results here")
    p.add_argument("--plot", metavar="PATH.png", help="plot throughput and latency p50 against concurrency")
    p.add_argument("--warmup", type=int, default=1, help="requests per mode before measuring (default: 1)")
    p.set_defaults(func=run)
    return p


# --- pure functions --------------------------------------------------------------------

def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def speculative_body(mode: str, k: int) -> dict:
    """The extra request body field of a speculation mode."""
    return {"off": {"speculative": False}, "auto": {}, "on": {"speculative": k}}[mode]


def disconnects(index: int, share: float) -> bool:
    """Whether request `index` of a level disconnects: spread evenly, floor(share * n) of n."""
    return math.floor((index + 1) * share) > math.floor(index * share)


@dataclass
class Result:
    """One request as the client saw it."""

    status: str  # ok | error | disconnected
    error: str | None = None  # HTTP status code or exception class
    ttft: float | None = None  # seconds to the first chunk with content
    itls: list[float] = field(default_factory=list)  # seconds between content chunks
    tokens: int = 0
    latency: float = 0.0
    acceptance: float | None = None


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 2)


def summarize(mode: str, concurrency: int, results: list[Result], wall: float) -> dict:
    """A level's row: throughput over the level's wall time, latencies of the finished requests."""
    ok = [r for r in results if r.status == "ok"]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    rates = [r.acceptance for r in ok if r.acceptance is not None]
    errors = [r.error for r in results if r.status == "error"]
    tokens = sum(r.tokens for r in ok)
    return {"mode": mode, "concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "errors": len(errors), "disconnected": sum(r.status == "disconnected" for r in results),
            "error_kinds": {e: errors.count(e) for e in sorted(set(errors))}, "completion_tokens": tokens,
            "wall_s": round(wall, 4), "tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "req_s": round(len(ok) / wall, 3) if wall > 0 else 0.0,
            "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "itl_p50_ms": _ms(percentile(itls, 50)), "itl_p99_ms": _ms(percentile(itls, 99)),
            "latency_p50_ms": _ms(percentile([r.latency for r in ok], 50)),
            "latency_p99_ms": _ms(percentile([r.latency for r in ok], 99)),
            "acceptance_rate": round(sum(rates) / len(rates), 4) if rates else None}


def speedups(rows: list[dict]) -> dict[str, list[float | None]]:
    """Each mode's tok/s over off's, level by level (None where off made no tokens)."""
    off = {r["concurrency"]: r["tok_s"] for r in rows if r["mode"] == "off"}
    out: dict[str, list[float | None]] = {}
    for r in rows:
        if r["mode"] != "off" and r["concurrency"] in off:
            base = off[r["concurrency"]]
            out.setdefault(r["mode"], []).append(round(r["tok_s"] / base, 3) if base else None)
    return out


def format_report(rows: list[dict], rss_mb_before: float | None = None) -> str:
    cells = [HEADER] + [tuple("" if r[k] is None else str(r[k]) for k in KEYS) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    for mode, ratios in speedups(rows).items():
        lines.append(f"{mode} / off: " + " ".join("-" if x is None else f"{x:.2f}x" for x in ratios))
    server = server_summary(rows, rss_mb_before)
    if server:
        lines.append(server)
    return "\n".join(lines)


def server_summary(rows: list[dict], rss_mb_before: float | None) -> str | None:
    """One line on the server's state after the levels: stuck sequences, 5xx answers, memory."""
    if not any("running_after" in r for r in rows):
        return None
    stuck = [r["running_after"] for r in rows]
    server_errors = sum(n for r in rows for kind, n in r.get("error_kinds", {}).items() if kind.startswith("5"))
    line = (f"server: {server_errors} answers 5xx; sequences running after each level: "
            + ", ".join(str(n) for n in stuck))
    after = [r.get("rss_mb_after") for r in rows]
    if rss_mb_before and all(after):
        line += (f"; resident memory {rss_mb_before:.0f} MB before, after each level "
                 + ", ".join(f"{mb:.0f}" for mb in after) + " MB")
        if len(after) > 1:  # the first level warms the server up to its batch: compare the last with it
            line += f" (last {after[-1] / after[0] - 1:+.1%} over the first)"
    return line


def load_prompts(spec: str) -> list[str]:
    """Prompt texts: from a JSONL file ('prompt' field, or the first of 'turns'), else from suites."""
    path = Path(spec)
    if not path.is_file():
        if spec.endswith(".jsonl"):
            raise SpecDecodeError(f"no prompt file {spec}")
        return [q.turns[0] for name in spec.split(",") for q in load_suite(name.strip())]
    try:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecDecodeError(f"cannot read the prompt file {path}: {e}") from None
    if not records:
        raise SpecDecodeError(f"the prompt file {path} holds no prompts")
    if all(isinstance(r, dict) and "turns" in r for r in records):
        return [q.turns[0] for q in load_prompt_file(path)]  # its checks and messages
    prompts = [r.get("prompt") if isinstance(r, dict) else None for r in records]
    if not all(isinstance(p, str) and p.strip() for p in prompts):
        raise SpecDecodeError(f"the prompt file {path} needs a non-empty 'prompt' (or 'turns') on every line")
    return prompts


# --- requests --------------------------------------------------------------------------

def _acceptance(extra) -> float | None:
    """The acceptance rate of a `speculation` extension field; None when absent or nothing was drafted."""
    spec = (extra or {}).get("speculation")
    if not isinstance(spec, dict) or spec.get("drafted") == 0:
        return None
    rate = spec.get("acceptance_rate")
    return float(rate) if isinstance(rate, (int, float)) else None


async def one_request(client, args, model: str, prompt: str, mode: str, disconnect: bool) -> Result:
    import asyncio

    import openai
    body = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                extra_body=speculative_body(mode, args.k))
    if args.chat:
        create, body["messages"] = client.chat.completions.create, [{"role": "user", "content": prompt}]
    else:
        create, body["prompt"] = client.completions.create, prompt
    start = time.perf_counter()
    result = Result("ok")
    try:
        async with asyncio.timeout(args.timeout):  # the client's own timeout is per read, not per request
            if not args.stream:
                response = await create(**body)
                result.tokens = response.usage.completion_tokens if response.usage else 0
                result.acceptance = _acceptance(response.model_extra)
            else:
                stream = await create(**body, stream=True, stream_options={"include_usage": True})
                last, chunks, usage = None, 0, None
                async for chunk in stream:
                    now = time.perf_counter()
                    usage = chunk.usage or usage
                    rate = _acceptance(chunk.model_extra)
                    result.acceptance = result.acceptance if rate is None else rate
                    choice = chunk.choices[0] if chunk.choices else None
                    text = (choice.delta.content if args.chat else choice.text) if choice else None
                    if not text:
                        continue
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last, chunks = now, chunks + 1
                    if disconnect and chunks >= DISCONNECT_AFTER:
                        await stream.close()  # the server sees the connection drop mid-stream
                        result.status = "disconnected"
                        break
                # a server that sends no usage: one token per content chunk
                result.tokens = usage.completion_tokens if usage else chunks
    except openai.APIStatusError as e:
        result = Result("error", error=str(e.status_code))
    except TimeoutError:
        result = Result("error", error="timeout")
    except Exception as e:  # a failed request is a measurement, not a reason to stop the run
        result = Result("error", error=type(e).__name__)
    result.latency = time.perf_counter() - start
    return result


async def run_level(client, args, model, prompts, mode, concurrency, first: int = 0):
    """`args.requests` requests through `concurrency` workers; returns (results, wall seconds)."""
    import asyncio

    from tqdm import tqdm
    results: list[Result | None] = [None] * args.requests
    indices = iter(range(args.requests))  # shared: each worker takes the next request
    bar = tqdm(total=args.requests, desc=f"{mode} c={concurrency}", file=sys.stderr, leave=False)

    async def worker():
        for i in indices:
            drop = args.stream and disconnects(i, args.disconnect)
            results[i] = await one_request(client, args, model, prompts[(first + i) % len(prompts)], mode, drop)
            bar.update()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    bar.close()
    return results, wall


async def server_state(url: str, api_key: str) -> dict | None:
    """Sequences running and resident MB, from the server's /metrics (next to /v1); None where
    the server publishes no specdecode metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    root = url.rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=10.0, headers={"Authorization": f"Bearer {api_key}"}) as http:
            response = await http.get(root + "/metrics")
        values = {sample.name: sample.value for family in text_string_to_metric_families(response.text)
                  for sample in family.samples}
    except (httpx.HTTPError, ValueError):
        return None
    if response.status_code != 200 or RUNNING not in values:
        return None
    rss = values.get(RESIDENT)
    return {"running": int(values[RUNNING]), "rss_mb": None if rss is None else round(rss / 2 ** 20, 1)}


async def settled_state(url: str, api_key: str) -> dict | None:
    """server_state once no sequence runs, or after SETTLE_S seconds (then it counts them)."""
    import asyncio
    deadline = time.perf_counter() + SETTLE_S
    while True:
        state = await server_state(url, api_key)
        if state is None or state["running"] == 0 or time.perf_counter() > deadline:
            return state
        await asyncio.sleep(0.2)


async def _resolve_model(client, args) -> str:
    import openai
    try:  # also the reachability check: fail in one line rather than with every request
        models = await client.with_options(timeout=min(args.timeout, 30.0)).models.list()
    except openai.APIStatusError as e:
        if args.model:
            return args.model
        raise SpecDecodeError(f"{args.url}/models answered {e.status_code}; name the model with --model") from None
    except (openai.APIConnectionError, OSError) as e:
        raise SpecDecodeError(f"cannot reach {args.url}: {e.__cause__ or e}") from None
    if args.model:
        return args.model
    if not models.data:
        raise SpecDecodeError(f"{args.url}/models lists no model; name one with --model")
    return models.data[0].id


async def run_all(args, prompts: list[str]) -> tuple[str, list[dict]]:
    import openai
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "none"
    # no retries: a failed request must show as an error, not as a slow success
    async with openai.AsyncOpenAI(base_url=args.url, api_key=api_key, max_retries=0, timeout=args.timeout) as client:
        model = await _resolve_model(client, args)
        for mode in args.speculative:
            for i in range(args.warmup):
                await one_request(client, args, model, prompts[i % len(prompts)], mode, False)
        rows, done = [], 0
        before = await settled_state(args.url, api_key)
        for concurrency in args.concurrency:
            for mode in args.speculative:  # modes side by side at each level, so drift hits both alike
                results, wall = await run_level(client, args, model, prompts, mode, concurrency, done)
                rows.append(summarize(mode, concurrency, results, wall))
                after = await settled_state(args.url, api_key)
                if after is not None:
                    rows[-1].update(running_after=after["running"], rss_mb_after=after["rss_mb"])
            done += args.requests
    return model, rows, (before or {}).get("rss_mb")


def plot(rows: list[dict], path) -> None:
    """Two panels against concurrency, one line per mode: tok/s, and request latency p50."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = sorted({r["concurrency"] for r in rows})
    for ax, key, label in zip(axes, ("tok_s", "latency_p50_ms"), ("completion tokens/s", "request latency p50 (ms)")):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["mode"] == mode]
            ax.plot([r["concurrency"] for r in mine], [r[key] for r in mine], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set(xlabel="concurrency", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    """Runs `specdecode load`; 0 when the run completed (failed requests are counted, not fatal)."""
    for flag, value, least in (("--requests", args.requests, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--k", args.k, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            raise SpecDecodeError(f"{flag} must be >= {least}, got {value}")
    if not 0 <= args.disconnect <= 1:
        raise SpecDecodeError(f"--disconnect is a share in [0, 1], got {args.disconnect}")
    if not args.timeout > 0:
        raise SpecDecodeError(f"--timeout must be > 0 seconds, got {args.timeout}")
    prompts = load_prompts(args.prompts)
    if not prompts:
        raise SpecDecodeError(f"--prompts {args.prompts} gives no prompts")
    import asyncio  # here, so that `specdecode --help` does not pay for it
    model, rows, rss_mb_before = asyncio.run(run_all(args, prompts))
    print(format_report(rows, rss_mb_before))
    if args.json_path:
        settings = {k: getattr(args, k) for k in ("url", "concurrency", "requests", "max_tokens", "prompts", "chat",
                                                  "stream", "disconnect", "speculative", "k", "temperature", "warmup")}
        Path(args.json_path).write_text(json.dumps({"model": model, "settings": settings, "rows": rows,
                                                    "speedups": speedups(rows), "rss_mb_before": rss_mb_before},
                                                   indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0
