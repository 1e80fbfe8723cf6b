"""The OpenAI-compatible web layer (FastAPI, served by uvicorn): requests in, the
scheduler's events out, as whole responses or Server-Sent Events.

Everything about a request is checked before it takes a place in the queue (its shape,
its model, its prompt against the context, its token budget), so a bad request gets a
4xx with OpenAI's error object and never reaches the decoding loop. A stream whose
client goes away cancels its sequence, which leaves the batch before the next step.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.core.batch import Sequence
from specdecode.core.draft_length import FixedK
from specdecode.core.prompts import encode_prompt
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition
from specdecode.errors import SpecDecodeError
from specdecode.policy.adaptive import AdaptiveK, CostModel
from specdecode.server.protocol import ChatRequest, CompletionRequest, Reply, error_body
from specdecode.server.scheduler import AUTO, Failed, Finished, Job, QueueFull, Scheduler
from specdecode.server.text import TextDeltas

WAIT_POLL_S = 0.5  # how often a whole-response request checks that its client is still there


@dataclass
class Service:
    """What the app serves: one target, its tokenizer, and the loop that decodes for it."""

    scheduler: Scheduler
    tokenizer: object
    model_name: str
    eos_token_ids: frozenset[int]
    context_len: int  # prompt + new tokens, at most
    new_drafter: Callable[[], object] | None  # a fresh chain drafter per request; None: plain only
    k_max: int  # the controller's longest draft
    default_max_tokens: int = 256
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    tree: bool = False  # the drafter proposes trees (Medusa, EAGLE): one sequence at a time


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body over max_bytes gets 413 before it is parsed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(error_body(f"the request body exceeds {self.max_bytes} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(service: Service) -> FastAPI:
    scheduler = service.scheduler

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)  # uvicorn has drained the open requests by now

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=service.max_body_bytes)

    @app.exception_handler(BadRequest)
    async def bad_request(request, error: BadRequest):
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        return JSONResponse(error_body(error.message, kind, error.param, error.code), error.status, error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:])
        if first.get("type") == "json_invalid":
            message, where = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", ""
        else:
            message = f"{where or 'body'}: {first.get('msg')}"
        return JSONResponse(error_body(message, param=where or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        return JSONResponse(error_body(str(error.detail)), error.status_code, getattr(error, "headers", None))

    async def authorized(request: Request):
        if service.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {service.api_key}".encode()):
            raise BadRequest(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(scheduler.running), "waiting": len(scheduler.waiting)}

    @app.get("/metrics")
    async def metrics():
        return Response(scheduler.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdecode", "max_model_len": service.context_len}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatRequest, request: Request):
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        return await _serve(service, body, request, _encode(service, messages, chat=True), chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(service, body, request, _encode(service, body.text, chat=False), chat=False)

    return app


def _encode(service: Service, prompt, chat: bool) -> list[int]:
    try:
        return encode_prompt(service.tokenizer, prompt, chat)
    except SpecDecodeError as error:
        raise BadRequest(400, str(error), "messages" if chat else "prompt")


def _job(service: Service, body, prompt_ids: list[int], deliver) -> Job:
    if body.model not in (None, service.model_name):
        raise BadRequest(404, f"the model {body.model!r} does not exist; this server serves {service.model_name!r}",
                         "model", "model_not_found")
    room = service.context_len - len(prompt_ids)
    if room <= 0:
        raise BadRequest(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {service.context_len}",
                         "messages", "context_length_exceeded")
    budget = body.token_budget or min(service.default_max_tokens, room)
    if budget > room:
        raise BadRequest(400, f"max_tokens {budget} and the prompt's {len(prompt_ids)} tokens exceed the context of "
                              f"{service.context_len}", "max_tokens", "context_length_exceeded")
    mode = body.speculation_mode
    if service.tree and mode not in (AUTO, False):
        raise BadRequest(400, "speculative: this server drafts trees, whose shape is fitted to this machine; "
                              "a fixed k does not apply", "speculative")
    if mode not in (AUTO, False) and mode > service.k_max:  # a longer pass could round rows differently
        raise BadRequest(400, f"speculative: this server drafts at most {service.k_max} tokens a round (--k-max)",
                         "speculative")
    drafter = None if mode is False or service.new_drafter is None else service.new_drafter()
    k_max = 0 if drafter is None else service.k_max if mode is AUTO else mode
    # the controller reads each sequence's acceptance from the adaptive policy's estimate
    policy = AdaptiveK(CostModel(0.0), k_max=max(k_max, 1)) if mode is AUTO else FixedK(k_max)
    seed = body.seed if body.seed is not None else random.getrandbits(62)
    try:
        stop = StopCondition(service.eos_token_ids, body.stop_strings, budget, service.tokenizer)
        sampling = SamplingConfig(body.temperature, body.top_k, body.top_p)
    except SpecDecodeError as error:
        raise BadRequest(400, str(error))
    seq = Sequence(prompt_ids, stop, sampling, drafter, policy, torch.Generator().manual_seed(seed), k_max)
    return Job(seq, deliver, mode, repeatable=body.seed is not None and not sampling.greedy)


async def _serve(service: Service, body, request: Request, prompt_ids: list[int], chat: bool):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = _job(service, body, prompt_ids, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    try:
        service.scheduler.submit(job)
    except QueueFull as error:
        service.scheduler.metrics.reject("queue_full")
        raise BadRequest(429, f"the server is busy: {error}; retry shortly", code="rate_limit_exceeded",
                         headers={"Retry-After": "1"})
    reply = Reply(chat, service.model_name)
    text = TextDeltas(service.tokenizer, body.stop_strings)
    first = await _next(events, request, job, service.scheduler)
    if isinstance(first, Failed):
        raise BadRequest(first.status, first.message)
    if body.stream:
        return StreamingResponse(_stream(service, events, job, reply, text, first, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    event, tokens = first, []
    while not isinstance(event, (Finished, Failed)):
        tokens += event.token_ids
        event = await _next(events, request, job, service.scheduler)
    if isinstance(event, Failed):
        raise BadRequest(500, event.message)
    return reply.whole(text.add(tokens, final=True), event.reason, event.stats)


async def _next(events: asyncio.Queue, request: Request, job: Job, scheduler: Scheduler):
    """The job's next event; cancels the job if its client disconnects meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), WAIT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                scheduler.cancel(job)
                raise asyncio.CancelledError("the client went away")


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(service: Service, events: asyncio.Queue, job: Job, reply: Reply, text: TextDeltas, event,
                  include_usage: bool):
    ended = False
    try:
        yield _sse(reply.chunk("", first=True) if reply.chat else reply.chunk(""))
        while not isinstance(event, (Finished, Failed)):
            delta = text.add(event.token_ids)
            if delta:
                yield _sse(reply.chunk(delta))
            event = await events.get()
        ended = True
        if isinstance(event, Failed):
            yield _sse(error_body(event.message, "server_error"))
        else:
            yield _sse(reply.chunk(text.add((), final=True), event.reason, event.stats))
            if include_usage:
                yield _sse(reply.usage_chunk(event.stats))
        yield _sse("[DONE]")
    finally:
        if not ended:  # the client went away mid-stream: free its place in the batch
            service.scheduler.cancel(job)
