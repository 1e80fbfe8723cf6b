"""`specdecode serve` as a client meets it: a real server process on 127.0.0.1 (SmolLM2),
talked to with the official `openai` client. Concurrent greedy completions equal
`generate` alone; every bad input gets its 4xx and leaves the server serving; a client
that leaves mid-stream leaves no sequence behind; SIGTERM drains what runs."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
KEY = "test-key"
PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "Repeat exactly: one two three four five six seven eight nine ten, one two three four five six seven.",
           "List three colours.", "Explain recursion in one sentence.", "def add(a, b):",
           "Translate 'good morning' into Spanish.", "Write a haiku about the sea."]
BUDGETS = [48, 12, 40, 20, 32, 8, 16, 28]  # ragged: sequences leave the batch at different steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path, *flags) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / f"server-{port}.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "specdecode.commands.cli", "serve", "--target", MODEL,
                                "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600  # the first start measures this machine's pass costs
    while time.time() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {(tmp_path / f'server-{port}.log').read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError("the server did not come up")


@pytest.fixture(scope="module")
def server(smollm2_folder, tmp_path_factory):
    process, url = start_server(tmp_path_factory.mktemp("server"), "--api-key", KEY, "--max-context", "512",
                                "--max-batch", "8")
    yield url
    process.terminate()
    process.wait(60)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.findall(rf"^specdecode:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    return sum(float(v) for v in found)


def test_concurrent_greedy_completions_are_each_alone(server):
    from specdecode.api import generate

    async def ask(client, prompt, budget, speculative):
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=budget, temperature=0,
                                                     extra_body={"speculative": speculative})
        return reply

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0) as client:
            modes = ["auto", False, 3, "auto", True, "auto", False, 4]
            return await asyncio.gather(*(ask(client, p, b, m) for p, b, m in zip(PROMPTS, BUDGETS, modes)))

    replies = asyncio.run(all_at_once())
    for prompt, budget, reply in zip(PROMPTS, BUDGETS, replies):
        alone = generate(prompt, MODEL, max_new_tokens=budget, temperature=0)
        assert reply.choices[0].message.content == alone.text, prompt
        assert reply.usage.completion_tokens == len(alone.token_ids)
        assert reply.choices[0].finish_reason == ("length" if alone.finish_reason == "length" else "stop")
    assert replies[1].model_extra["speculation"]["drafted"] == 0  # speculative: false decodes plainly
    assert replies[2].model_extra["speculation"]["drafted"] > 0  # a fixed k drafts on the repetitive prompt
    assert metric(server, "batch_size_sum") > metric(server, "batch_size_count")  # steps shared the batch


def test_streams_chat_and_completions(client, server):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                                 max_tokens=30, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                           max_tokens=30, temperature=0)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert "speculation" in chunks[-1].model_extra

    completion = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=16, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def fib(n):", max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == completion.choices[0].text and completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"


def test_stop_strings_and_seeded_sampling(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0)
    cut = base.choices[0].text[4:7]
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0, stop=[cut])
    assert stopped.choices[0].text == base.choices[0].text[:base.choices[0].text.find(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    draws = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=1.0,
                                       top_p=0.95, seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert draws[0] == draws[1] != draws[2]


@pytest.mark.parametrize("body, status, words", [
    ('{"model": "smollm2-135m-instruct", "prompt": "x"', 400, "not valid JSON"),
    ('{"model": "gpt-9", "prompt": "hello"}', 404, "does not exist"),
    ('{"prompt": ""}', 400, "empty"),
    ('{"prompt": "' + "word " * 700 + '"}', 400, "context"),
    ('{"prompt": "hello", "max_tokens": 100000}', 400, "exceed the context"),
    ('{"prompt": "hello", "temperature": -0.5}', 400, "temperature"),
    ('{"prompt": "hello", "n": 2}', 400, "n:"),
    ('{"prompt": "hello", "max_tokens": "lots"}', 400, "max_tokens"),
    ('{"prompt": "hello", "top_p": 0}', 400, "top_p"),
    ('{"prompt": "hello", "speculative": 0}', 400, "speculative"),
    ('{"prompt": "hello", "speculative": 12}', 400, "at most 8"),
    ('{"messages": []}', 400, "messages"),
])
def test_bad_input_gets_its_4xx_and_the_server_goes_on(server, body, status, words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(server + path, content=body, headers={"Authorization": f"Bearer {KEY}",
                                                                 "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_key_body_size_and_openai_errors(server, client):
    assert httpx.get(server + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [MODEL]
    huge = httpx.post(server + "/v1/completions", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}',
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert huge.status_code == 413 and "exceeds" in huge.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)


def test_a_client_leaving_mid_stream_frees_its_sequence(server, client):
    aborted = metric(server, "request_aborted_total")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story "
                                            "about a dragon."}], max_tokens=400, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 20
    while time.time() < deadline and (metric(server, "num_requests_running") > 0
                                      or metric(server, "request_aborted_total") <= aborted):
        time.sleep(0.2)
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "request_aborted_total") == aborted + 1
    assert metric(server, "spec_decode_num_draft_tokens_total") > 0  # vLLM's names, counted
    assert metric(server, "time_to_first_token_seconds_count") > 0


def test_load_reports_what_clients_leaving_left_behind(server, tmp_path, capsys):
    import argparse
    import json

    from specdecode.commands import load
    parser = argparse.ArgumentParser()
    load.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "load.json"
    args = parser.parse_args(["load", "--url", server + "/v1", "--api-key", KEY, "--concurrency", "2", "--requests", "4",
                              "--max-tokens", "24", "--disconnect", "0.5", "--speculative", "auto", "--warmup", "0",
                              "--json", str(out)])
    assert load.run(args) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["ok"], row["disconnected"], row["errors"]) == (2, 2, 0)
    assert row["running_after"] == 0 and row["rss_mb_after"] > 100 and result["rss_mb_before"] > 100
    assert capsys.readouterr().out.splitlines()[-1].startswith("server: 0 answers 5xx; sequences running after "
                                                               "each level: 0; resident memory ")


def test_a_full_queue_answers_429_and_sigterm_drains(smollm2_folder, tmp_path):
    process, url = start_server(tmp_path, "--max-batch", "1", "--max-queue", "1")

    async def three():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            body = {"prompt": "Count from one to one hundred in words.", "max_tokens": 60, "temperature": 0}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(3)))

    statuses = sorted(r.status_code for r in asyncio.run(three()))
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    refused = next(r for r in asyncio.run(three()) if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and "busy" in refused.json()["error"]["message"]

    async def terminate_mid_request():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            running = asyncio.create_task(http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "max_tokens": 120,
                "temperature": 0}))
            while (await http.get("/health")).json()["running"] == 0:
                assert not running.done(), running.result().text
                await asyncio.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            return await running

    finished = asyncio.run(terminate_mid_request())
    assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 120
    assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn drains, then ends by the signal it caught


def resident_kib(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))


@pytest.mark.slow
def test_soak_with_clients_leaving_mid_stream(smollm2_folder, tmp_path):
    """500 requests from 16 clients, one in ten leaving mid-stream: no 5xx, no sequence
    left behind, and resident memory back within 10% of where it stood after a warm-up."""
    process, url = start_server(tmp_path, "--max-batch", "8", "--max-queue", "64")
    prompts = PROMPTS + ["Summarise: the cat sat on the mat because the mat was warm and the cat was cold."]

    async def one(client, i):
        messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
        if i % 10 == 9:  # this client leaves after two chunks
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64,
                                                          temperature=0.7, seed=i, stream=True)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.close()
            return "left"
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                     temperature=0.7 if i % 2 else 0, seed=i)
        return reply.choices[0].finish_reason

    async def clients(first, count):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            gate = asyncio.Semaphore(16)

            async def limited(i):
                async with gate:
                    try:
                        return await one(client, i)
                    except openai.APIStatusError as error:
                        return error.status_code

            return await asyncio.gather(*(limited(i) for i in range(first, first + count)))

    try:
        asyncio.run(clients(0, 50))  # warm-up: every buffer the steady state needs
        before = resident_kib(process.pid)
        outcomes = asyncio.run(clients(50, 500))
        deadline = time.time() + 20
        while time.time() < deadline and metric(url, "num_requests_running") > 0:
            time.sleep(0.2)
        after = resident_kib(process.pid)
        assert not [o for o in outcomes if isinstance(o, int)], outcomes  # no error status at all
        assert outcomes.count("left") == 50
        assert metric(url, "num_requests_running") == 0 and metric(url, "num_requests_waiting") == 0
        # every request either finished or was dropped when its client left: none lingers
        assert metric(url, "request_success_total") + metric(url, "request_aborted_total") == 550
        assert metric(url, "request_aborted_total") > 0
        assert after <= 1.10 * before, (before, after)
    finally:
        process.terminate()
        process.wait(60)


@pytest.mark.parametrize("drafter", ["medusa", "eagle"])
def test_tree_drafters_serve_one_sequence_at_a_time(smollm2_folder, tmp_path, drafter):
    from specdecode.api import generate

    process, url = start_server(tmp_path, "--drafter", drafter, "--max-batch", "1")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        async def two_at_once():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as aclient:
                return await asyncio.gather(*(aclient.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=b, temperature=0)
                    for p, b in zip(PROMPTS[:2], BUDGETS[:2])))

        for prompt, budget, reply in zip(PROMPTS[:2], BUDGETS[:2], asyncio.run(two_at_once())):
            assert reply.choices[0].message.content == generate(prompt, MODEL, max_new_tokens=budget, temperature=0).text
            assert reply.model_extra["speculation"]["rounds"] > 0
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=BUDGETS[0], temperature=0,
            stream=True) if c.choices)
        assert streamed == generate(PROMPTS[0], MODEL, max_new_tokens=BUDGETS[0], temperature=0).text
        with pytest.raises(openai.BadRequestError, match="k does not apply"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"speculative": 3})
        assert metric(url, "request_success_total") == 3
    finally:
        process.terminate()
        process.wait(60)
