"""`specdecode load` against a small fake OpenAI-compatible server run in this process."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from specdecode.commands import load  # noqa: E402
from specdecode.errors import SpecDecodeError  # noqa: E402

SPECULATION = {"drafted": 10, "accepted": 7, "acceptance_rate": 0.7, "mean_accepted_length": 2.4}


class FakeState:
    def __init__(self):
        self.reset()

    def reset(self, fail_every: int = 0, usage: bool = True, chunk_s: float = 0.002):
        self.bodies: list[dict] = []
        self.chunk_s = chunk_s  # between content chunks
        self.fail_every = fail_every  # every n-th request answers 500
        self.usage = usage
        self.finished = 0  # streams sent to the end
        self.aborted = 0  # streams the client closed early


def make_app(state: FakeState):
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "t"},
                                           {"id": "other", "object": "model", "created": 0, "owned_by": "t"}]}

    async def complete(request, chat: bool):
        body = await request.json()
        state.bodies.append(body)
        if state.fail_every and len(state.bodies) % state.fail_every == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        n = body["max_tokens"]
        # the specdecode server reports speculation unless it was turned off
        extra = {} if body.get("speculative") is False else {"speculation": SPECULATION}
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        kind = "chat.completion" if chat else "text_completion"

        def choice(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        if not body.get("stream"):
            message = ({"message": {"role": "assistant", "content": "tok " * n}} if chat else {"text": "tok " * n})
            return {"id": "x", "object": kind, "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "length", **message}], "usage": usage, **extra}

        async def events():
            done = False
            base = {"id": "x", "object": kind + (".chunk" if chat else ""), "created": 0, "model": body["model"]}
            try:
                for _ in range(n):
                    await asyncio.sleep(state.chunk_s)
                    yield f"data: {json.dumps({**base, 'choices': [choice('tok ')]})}\n\n"
                last = {**base, "choices": [choice(None, "length")]}
                yield f"data: {json.dumps(last)}\n\n"
                final = {**base, "choices": [], **extra}
                if state.usage and body.get("stream_options", {}).get("include_usage"):
                    final["usage"] = usage
                yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"
                done = True
            finally:
                if done:
                    state.finished += 1
                else:
                    state.aborted += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await complete(request, chat=False)

    return app


@pytest.fixture(scope="module")
def server():
    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started:
        assert time.time() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1", state
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def fake(server):
    url, state = server
    state.reset()
    return url, state


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(3)))
    return str(path)


def parse(*argv):
    parser = argparse.ArgumentParser()
    load.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["load", *argv])


def run_load(url, *argv):
    args = parse("--url", url, "--disconnect", "0", "--warmup", "0", *argv)
    assert load.run(args) == 0
    return args


def test_percentile_nearest_rank():
    values = [40, 15, 50, 35, 20]  # sorted: 15 20 35 40 50
    assert load.percentile(values, 0) == 15
    assert load.percentile(values, 30) == 20  # rank ceil(1.5) = 2
    assert load.percentile(values, 40) == 20  # rank 2 exactly
    assert load.percentile(values, 50) == 35  # rank ceil(2.5) = 3
    assert load.percentile(values, 99) == 50
    assert load.percentile(values, 100) == 50
    assert load.percentile(list(range(1, 101)), 99) == 99
    assert load.percentile(list(range(1, 101)), 50) == 50
    assert load.percentile([7.5], 99) == 7.5
    assert load.percentile([], 50) is None


def test_pure_helpers():
    assert load.speculative_body("off", 4) == {"speculative": False}
    assert load.speculative_body("auto", 4) == {}
    assert load.speculative_body("on", 3) == {"speculative": 3}
    assert sum(load.disconnects(i, 0.25) for i in range(8)) == 2
    assert [i for i in range(10) if load.disconnects(i, 0.3)] == [3, 6, 9]
    assert not any(load.disconnects(i, 0.0) for i in range(50))
    rows = [{"mode": "off", "concurrency": 1, "tok_s": 100.0}, {"mode": "auto", "concurrency": 1, "tok_s": 131.0},
            {"mode": "off", "concurrency": 2, "tok_s": 200.0}, {"mode": "auto", "concurrency": 2, "tok_s": 196.0}]
    assert load.speedups(rows) == {"auto": [1.31, 0.98]}


def test_server_summary_counts_stuck_sequences_5xx_and_memory():
    rows = [{"running_after": 0, "rss_mb_after": 600.0, "error_kinds": {"503": 2, "timeout": 1}},
            {"running_after": 1, "rss_mb_after": 630.0, "error_kinds": {"500": 1}}]
    assert load.server_summary(rows, 500.0) == ("server: 3 answers 5xx; sequences running after each level: 0, 1; "
                                                "resident memory 500 MB before, after each level 600, 630 MB "
                                                "(last +5.0% over the first)")
    assert load.server_summary([{"tok_s": 1.0}], None) is None  # a server without specdecode's metrics


def test_rows_counts_tokens_and_speculative_field(fake, prompt_file, tmp_path, capsys):
    url, state = fake
    out = tmp_path / "load.json"
    run_load(url, "--concurrency", "1,3", "--requests", "6", "--max-tokens", "5", "--speculative", "auto,off,on",
             "--k", "3", "--prompts", prompt_file, "--json", str(out))
    result = json.loads(out.read_text())
    assert result["model"] == "fake-model"  # the first one /models lists
    rows = result["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        ("auto", 1), ("off", 1), ("on", 1), ("auto", 3), ("off", 3), ("on", 3)]
    for r in rows:
        assert (r["requests"], r["ok"], r["errors"], r["disconnected"]) == (6, 6, 0, 0)
        assert r["completion_tokens"] == 6 * 5
        assert r["tok_s"] == pytest.approx(30 / r["wall_s"], rel=0.01)
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0 and r["itl_p99_ms"] >= r["itl_p50_ms"]
        assert r["acceptance_rate"] == (None if r["mode"] == "off" else 0.7)
    assert set(result["speedups"]) == {"auto", "on"} and len(result["speedups"]["auto"]) == 2
    # the body field per mode: off -> false, auto -> absent, on -> the integer k
    bodies = state.bodies
    assert len(bodies) == 36
    assert sum(b.get("speculative", "absent") is False for b in bodies) == 12
    assert sum("speculative" not in b for b in bodies) == 12
    assert sum(type(b.get("speculative")) is int and b["speculative"] == 3 for b in bodies) == 12
    assert all(b["model"] == "fake-model" and b["max_tokens"] == 5 and b["stream"] is True
               and b["stream_options"] == {"include_usage": True} for b in bodies)
    # one at a time, the prompts cycle in order
    first_level = [b["messages"][0]["content"] for b in bodies[:6]]
    assert first_level == ["prompt 0", "prompt 1", "prompt 2"] * 2
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["mode", "concurrency", "tok/s"]
    assert len(table) == 1 + 6 + 2
    assert table[-2].startswith("auto / off: ") and table[-1].startswith("on / off: ")
    assert len(table[-2].split()[3:]) == 2 and all(x.endswith("x") for x in table[-2].split()[3:])


def test_tokens_counted_from_chunks_without_usage(fake, prompt_file, tmp_path):
    url, state = fake
    state.reset(usage=False)
    out = tmp_path / "load.json"
    run_load(url, "--concurrency", "2", "--requests", "4", "--max-tokens", "7", "--speculative", "auto",
             "--prompts", prompt_file, "--json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["ok"], row["completion_tokens"], row["acceptance_rate"]) == (4, 28, 0.7)


def test_no_stream_completions(fake, prompt_file, tmp_path):
    url, state = fake
    out = tmp_path / "load.json"
    run_load(url, "--concurrency", "2", "--requests", "4", "--max-tokens", "6", "--speculative", "auto,off",
             "--no-chat", "--no-stream", "--model", "other", "--prompts", prompt_file, "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["ok"], r["completion_tokens"], r["acceptance_rate"]) for r in rows] == [
        ("auto", 4, 24, 0.7), ("off", 4, 24, None)]
    assert rows[0]["ttft_p50_ms"] is None and rows[0]["latency_p50_ms"] > 0
    assert all(b["model"] == "other" and "prompt" in b and "messages" not in b and not b.get("stream")
               for b in state.bodies)


def test_disconnects_are_counted_apart_from_errors(fake, prompt_file, tmp_path):
    url, state = fake
    # chunks far enough apart that the server sees a client leave before its stream could
    # end (at 2 ms a chunk, a busy machine sometimes sent all 20 first)
    state.reset(chunk_s=0.02)
    out = tmp_path / "load.json"
    run_load(url, "--concurrency", "2", "--requests", "8", "--max-tokens", "20", "--speculative", "auto",
             "--prompts", prompt_file, "--json", str(out), "--disconnect", "0.25")
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["requests"], row["ok"], row["disconnected"], row["errors"]) == (8, 6, 2, 0)
    assert row["completion_tokens"] == 6 * 20  # disconnected requests' tokens are not counted
    deadline = time.time() + 5
    while state.aborted + state.finished < 8 and time.time() < deadline:
        time.sleep(0.02)
    assert (state.finished, state.aborted) == (6, 2)  # the server saw two streams dropped


def test_server_errors_are_counted(fake, prompt_file, tmp_path):
    url, state = fake
    state.reset(fail_every=3)
    out = tmp_path / "load.json"
    run_load(url, "--concurrency", "2", "--requests", "9", "--max-tokens", "4", "--speculative", "off",
             "--prompts", prompt_file, "--json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    # no retries: exactly the 3rd, 6th and 9th requests fail
    assert len(state.bodies) == 9
    assert (row["ok"], row["errors"], row["disconnected"], row["error_kinds"]) == (6, 3, 0, {"500": 3})
    assert row["completion_tokens"] == 6 * 4


def test_unreachable_url(prompt_file):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(SpecDecodeError, match=f"cannot reach {url}"):
        load.run(parse("--url", url, "--prompts", prompt_file))


def test_empty_or_bad_prompts(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecDecodeError, match="holds no prompts"):
        load.load_prompts(str(empty))
    no_field = tmp_path / "bad.jsonl"
    no_field.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SpecDecodeError, match="needs a non-empty 'prompt'"):
        load.load_prompts(str(no_field))
    with pytest.raises(SpecDecodeError, match="no prompt file"):
        load.load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(SpecDecodeError, match="not a known task suite"):
        load.load_prompts("no-such-suite")
    turns = tmp_path / "mt.jsonl"
    turns.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["first", "second"]}) + "\n")
    assert load.load_prompts(str(turns)) == ["first"]
    assert len(load.load_prompts("chat")) == 12


def test_plot_is_a_png(fake, prompt_file, tmp_path):
    url, _ = fake
    png = tmp_path / "load.png"
    run_load(url, "--concurrency", "1,2", "--requests", "2", "--max-tokens", "3", "--prompts", prompt_file,
             "--plot", str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > height > 200
