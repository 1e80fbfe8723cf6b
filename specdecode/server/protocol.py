"""The OpenAI API's request and response shapes, as far as the server takes them.

Requests are pydantic models: a field of the wrong type or out of range fails
validation, which the app answers with a 400 and OpenAI's error object. Fields the API
has and the server does not use (penalties, logit_bias, user) are accepted and ignored,
as other OpenAI-compatible servers do; those whose meaning would change the answer
(`n` > 1, logprobs, tools) are refused. Extensions: `top_k`, and `speculative`
(true or "auto": the goodput controller's draft length; false: plain decoding; an
integer: that fixed draft length). Every response carries the request's speculation
figures in `speculation` (drafted, accepted, acceptance rate, mean accepted length).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from specdecode.core.events import Stats

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What chat and completion requests share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    seed: int | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Literal[False, None] = None
    speculative: Union[StrictBool, Literal["auto"], Annotated[StrictInt, Field(ge=1, le=16)]] = "auto"

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("a stop string must be non-empty")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def speculation_mode(self):
        """None (auto), False (plain) or a fixed k, as the scheduler takes it."""
        if self.speculative is True or self.speculative == "auto":
            return None
        return self.speculative

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: None = None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def speculation(stats: Stats) -> dict:
    return {"drafted": stats.draft_tokens, "accepted": stats.accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 4), "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "rounds": stats.rounds}


class Reply:
    """One request's response objects: the whole reply, or the chunks of its stream."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, reason: str, stats: Stats) -> dict:
        finish = FINISH_REASONS[reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": usage(stats), "speculation": speculation(stats)}

    def chunk(self, text: str, reason: str | None = None, stats: Stats | None = None, first: bool = False) -> dict:
        finish = FINISH_REASONS[reason] if reason else None
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return body | ({"speculation": speculation(stats)} if stats is not None else {})

    def usage_chunk(self, stats: Stats) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": usage(stats), "speculation": speculation(stats)}
