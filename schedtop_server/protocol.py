"""The OpenAI request bodies the server accepts, validated strictly (an unknown field is a
400, not silently ignored), and the response shapes it sends."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from engine.request import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """OpenAI's stream_options."""

    include_usage: bool = False  # a last chunk with the usage counts
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class ChatMessage(_Strict):
    """One message of a chat prompt."""

    role: Literal["system", "user", "assistant", "tool", "developer"]  # who speaks
    content: str  # plain text only
    name: str | None = None  # an optional speaker name (passed to the template)


class _Sampling(_Strict):
    """The parameters both endpoints share (vLLM's extensions included)."""

    model: str | None = None  # must name the served model when given
    n: Annotated[int, Field(ge=1)] = 1  # only 1 is supported
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0  # 0 = greedy
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0  # nucleus mass kept
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM: -1 or 0 = off
    seed: StrictInt | None = None  # per-request generator: the same tokens in any batch
    stop: str | list[str] | None = None  # stop strings, cut from the text
    ignore_eos: StrictBool = False  # vLLM: keep going past EOS
    priority: StrictInt = 0  # vLLM: lower runs first under --scheduling-policy priority
    stream: StrictBool = False  # server-sent events
    stream_options: StreamOptions | None = None  # only with stream
    user: str | None = None  # accepted and ignored, as OpenAI allows

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )

    def problem(self) -> tuple[str, str] | None:
        """(message, param) for what pydantic cannot say alone."""
        if self.n != 1:
            return "only n=1 is supported", "n"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true", "stream_options"
        if len(self.stop_strings()) > 4:
            return "at most 4 stop strings", "stop"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return "seed must be in [0, 2**63)", "seed"
        return None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | Annotated[list[StrictInt], Field(min_length=1)]  # text or token ids
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default; None: to the limit


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]  # the conversation
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to max_model_len
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "server_overloaded",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str | None) -> str | None:
    """The engine's reasons in OpenAI's words ("error" has none: say "abort", as vLLM)."""
    return None if reason is None else ("abort" if reason == "error" else reason)


class Shapes:
    """Builds one endpoint's response objects: completions and chat differ only in shape."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, reason: str | None, prompt: int, completion: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(reason)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["logprobs"] = None
        return {**self._base(self.object), "choices": [choice], "usage": usage(prompt, completion)}

    def chunk(self, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(reason)}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
            choice["logprobs"] = None
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [choice]}

    def usage_chunk(self, prompt: int, completion: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(prompt, completion)}
