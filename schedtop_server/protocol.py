"""The OpenAI request bodies the server accepts and the response shapes it sends.

The schema is vLLM 0.33's: every field its CompletionRequest and ChatCompletionRequest
define is accepted, those this server implements with their meaning, the others
(NEUTRAL_*) only at values that change nothing, so that no client gets output that
silently ignores what it asked for. A field vLLM does not define is a 400 as well."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from engine.outputs import TokenLogprobs
from engine.request import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """OpenAI's stream_options (vLLM's types: null means false)."""

    include_usage: StrictBool | None = False  # a last chunk with the usage counts
    continuous_usage_stats: StrictBool | None = False  # vLLM's: usage on every chunk too


class TextPart(_Strict):
    """A chat content part of type text (OpenAI's list form of `content`)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message of a chat prompt."""

    role: Literal["system", "user", "assistant", "tool", "developer"]  # who speaks
    content: str | list[TextPart] | None = None  # text, or text parts (joined by newlines)
    name: str | None = None  # an optional speaker name (passed to the template)
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None  # none: no tools here

    def text(self) -> str:
        """The content as the template sees it: text parts joined with newlines, as
        vLLM's "string" content format does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


# vLLM 0.33's request fields that this server does not implement, each with the values at
# which it changes nothing in the output (null always means the default). Any other value
# is refused with a 400 naming the field: a client must not get output that silently
# ignores what it asked for. `ANY` marks fields that never change the output here (routing
# and bookkeeping hints, multimodal or reasoning knobs of a text-only, non-reasoning model).
ANY: tuple[Any, ...] = ("<any>",)
_NEUTRAL_BOTH: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "watermarking": (),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "truncation_side": ("left", "right"),  # only matters with truncate_prompt_tokens
    "allowed_token_ids": (),
    "prompt_logprobs": (),
    "logprob_token_ids": (),
    "bad_words": ([],),
    "prompt_embeds": (),
    "response_format": ({"type": "text"},),
    "structured_outputs": (),
    "session_id": ANY,  # a routing hint
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "return_weight_versions": (False,),
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,),
    "mm_payload": ANY,  # how multimodal outputs travel: there are none
    "return_mm_kwargs": (False,),
    "cache_salt": ANY,  # isolates prefix-cache hits; the output is the same
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "vllm_xargs": ({},),
    "repetition_detection": (),
    "thinking_token_budget": (),
    "stream_interval": ANY,  # how often vLLM streams; the text is the same
    "best_of": (1,),
}
NEUTRAL_COMPLETION: dict[str, tuple[Any, ...]] = {
    **_NEUTRAL_BOTH,
    "suffix": (),
    "add_special_tokens": (True,),  # the tokenizer's special tokens: what encode() does
}
NEUTRAL_CHAT: dict[str, tuple[Any, ...]] = {
    **_NEUTRAL_BOTH,
    "echo": (False,),  # chat's: prepend the last message of the same role
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, "auto" calls none either
    "parallel_tool_calls": ANY,  # no tools
    "reasoning_effort": (),
    "include_reasoning": ANY,  # no reasoning parser: nothing to include or leave out
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),  # the chat template has them already
    "documents": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "media_io_kwargs": ({},),
    "mm_processor_kwargs": ({},),
    "return_prompt_text": (False,),
}


def _same(a: Any, b: Any) -> bool:
    """JSON equality without Python's True == 1 (a bool is not a number here)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def take_neutral(data: dict[str, Any], neutral: dict[str, tuple[Any, ...]]) -> str | None:
    """Remove from `data` the unimplemented fields sent at values that change nothing;
    the first one that would change the output: its name (data is then left as is)."""
    for key in [k for k in data if k in neutral]:
        value, allowed = data[key], neutral[key]
        if value is None or allowed is ANY or any(_same(value, a) for a in allowed):
            del data[key]
        else:
            return key
    return None


def refusal(key: str, value: Any, neutral: dict[str, tuple[Any, ...]]) -> str:
    """The 400's message for an unimplemented field sent at a value that matters."""
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    allowed = ", ".join(["null", *(json.dumps(a) for a in neutral[key])])
    return (
        f"{key}={shown} is not supported by this server; it accepts {key} only where it "
        f"changes nothing: {allowed}"
    )


def media_problem(data: dict[str, Any]) -> tuple[str, str] | None:
    """(message, param) for a chat content part other than text, before pydantic, whose
    message would list every union member that failed instead of saying why."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return None
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                param = f"messages.{i}.content.{j}"
                what = f"{kind!r} content parts are" if isinstance(kind, str) else "this part is"
                return (
                    f"{param}: {what} not supported: this server serves a text-only model "
                    'and takes only {"type": "text", "text": ...} parts',
                    param,
                )
    return None


MAX_CLIENT_ID = 256  # characters of a client's request id (it goes into the trace)
MAX_N = 64  # choices of one request (n): each is a request of its own in the engine
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
# Integers that reach the trace are bounded here: the trace's integers are 64-bit, and a
# value past that (priority 2**64) used to end the flight recorder while serving went on.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class _Sampling(_Strict):
    """The parameters both endpoints share (vLLM's extensions included)."""

    model: str | None = None  # must name the served model when given
    # parallel sampling: n requests that share the prompt's KV blocks (the prefix cache)
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # 0 = greedy; null: 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None  # nucleus mass kept; null: 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # -1, 0 or null = off
    seed: StrictInt | None = None  # per-request generator: the same tokens in any batch
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0  # vLLM's meaning
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = 1.0
    min_p: Annotated[float, Field(ge=0, le=1)] | None = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    stop: str | list[str] | None = None  # stop strings, cut from the text
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]] | None = None
    include_stop_str_in_output: StrictBool | None = False  # vLLM: keep the stop string
    skip_special_tokens: StrictBool | None = True  # vLLM: special tokens left out of text
    ignore_eos: StrictBool | None = False  # vLLM: keep going past EOS
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = 0  # vLLM: see problem()
    # vLLM: lower runs first under --scheduling-policy priority
    priority: Annotated[StrictInt, Field(ge=INT32_MIN, le=INT32_MAX)] | None = 0
    stream: StrictBool | None = False  # server-sent events
    stream_options: StreamOptions | None = None  # only with stream
    user: str | None = None  # recorded as the request's tenant (its first 256 characters)
    request_id: str | None = None  # vLLM: the client's id (X-Request-Id wins)

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def usage_options(self) -> tuple[bool, bool]:
        """(a last usage chunk, usage on every chunk), as vLLM reads stream_options."""
        o = self.stream_options
        if not self.stream or o is None or not o.include_usage:
            return False, False
        return True, bool(o.continuous_usage_stats)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=self.bias(),
            logprobs=self.top_logprobs_wanted(),
        )

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, each bias clamped to [-100, 100] as vLLM
        does (problem() has checked the keys)."""
        if not self.logit_bias:
            return ()
        return tuple(
            (int(k), min(100.0, max(-100.0, v))) for k, v in sorted(self.logit_bias.items())
        )

    def top_logprobs_wanted(self) -> int | None:
        """How many top logprobs each token comes with; None: no logprobs at all."""
        raise NotImplementedError

    def output_limit(self) -> int | None:
        raise NotImplementedError

    def problem(self) -> tuple[str, str] | None:
        """(message, param) for what pydantic cannot say alone."""
        if self.logit_bias:
            for k, v in self.logit_bias.items():
                if not (k.isascii() and k.isdigit() and len(k) <= 10):
                    return f"logit_bias: {k[:40]!r} is not a token id", "logit_bias"
                if not math.isfinite(v):
                    return f"logit_bias: the bias of {k} is not a finite number", "logit_bias"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true", "stream_options"
        if len(self.stop_strings()) > 4:
            return "at most 4 stop strings", "stop"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return "seed must be in [0, 2**63)", "seed"
        if self.request_id is not None and not 0 < len(self.request_id) <= MAX_CLIENT_ID:
            return f"request_id must be 1 to {MAX_CLIENT_ID} characters", "request_id"
        limit = self.output_limit()
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            return f"min_tokens={self.min_tokens} is above max_tokens={limit}", "min_tokens"
        if self.min_tokens and (not self.ignore_eos or self.stop_strings() or self.stop_token_ids):
            # Only then can the output end before min_tokens, and the engine has no
            # minimum: with ignore_eos and nothing else to stop on it changes nothing.
            return (
                "min_tokens > 0 is only supported with ignore_eos=true and no stop or "
                "stop_token_ids (this server does not enforce a minimum)",
                "min_tokens",
            )
        return None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | Annotated[list[StrictInt], Field(min_length=1)]  # text or token ids
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default; None: to the limit
    # the sampled tokens' logprobs, each with this many most likely tokens
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool | None = False  # the prompt's text before the output

    def output_limit(self) -> int | None:
        return self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def problem(self) -> tuple[str, str] | None:
        if self.echo and self.logprobs is not None:
            # vLLM then returns the prompt's logprobs as well, which this server does not
            # compute (its runner takes logits only where a request samples).
            return "echo with logprobs is not supported (no prompt logprobs here)", "echo"
        return super().problem()


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]  # the conversation
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to max_model_len
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name
    logprobs: StrictBool | None = False  # each output token's logprob...
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = 0  # ...and these

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def problem(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs=true", "top_logprobs"
        return super().problem()

    def chat(self) -> list[dict[str, str]]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


class TokenizeRequest(_Strict):
    """POST /tokenize, vLLM's: a prompt or chat messages (the template applied)."""

    model: str | None = None  # must name the served model when given
    prompt: str | None = None  # text...
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None  # ...or a chat
    add_special_tokens: StrictBool | None = None  # null: true for a prompt (BOS), false for chat
    add_generation_prompt: StrictBool | None = True  # chat: end with the assistant's turn
    return_token_strs: StrictBool | None = False  # each token's string, too

    def problem(self) -> tuple[str, str] | None:
        if (self.prompt is None) == (self.messages is None):
            return "give exactly one of prompt and messages", "prompt"
        return None


class DetokenizeRequest(_Strict):
    """POST /detokenize, vLLM's."""

    model: str | None = None  # must name the served model when given
    tokens: list[Annotated[StrictInt, Field(ge=0)]]  # token ids (checked against the vocab)


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        408: "timeout_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "server_overloaded",
        507: "insufficient_storage",
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


LOGPROB_FLOOR = -9999.0  # what vLLM sends for -inf (JSON has no infinity)


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice of a whole (non-streamed) response."""

    text: str
    finish_reason: str | None
    logprobs: tuple[TokenLogprobs, ...] | None = None  # when the request asked for them
    text_offset: int = 0  # completions: where the output starts in `text` (after an echo)


class Shapes:
    """Builds one endpoint's response objects: completions and chat differ only in shape.
    `token_str` spells a token id for logprobs (the tokenizer's decoding of it alone)."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        token_str: Callable[[int], str] | None = None,
    ) -> None:
        self.chat = chat
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.token_str = token_str or str

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, lps: Sequence[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
        """OpenAI's logprobs object for these tokens: chat's `content` list, or the
        completions API's parallel lists (`offset`: the text's length before them)."""
        spell = self.token_str
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in lps]}
        tokens = [spell(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        tops = []
        for lp in lps:
            # vLLM's: the k most likely, and the sampled token among them (set last: two
            # tokens may spell the same, as pieces of characters do, and the sampled one's
            # value is the one token_logprobs has)
            top = {spell(t): max(v, LOGPROB_FLOOR) for t, v in lp.top}
            top[spell(lp.token_id)] = max(lp.logprob, LOGPROB_FLOOR)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [max(lp.logprob, LOGPROB_FLOOR) for lp in lps],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, lp: TokenLogprobs) -> dict[str, Any]:
        spell = self.token_str

        def one(token_id: int, value: float) -> dict[str, Any]:
            text = spell(token_id)
            return {
                "token": text,
                "logprob": max(value, LOGPROB_FLOOR),
                "bytes": list(text.encode("utf-8", errors="replace")),
            }

        entry = one(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [one(t, v) for t, v in lp.top]
        return entry

    def full(self, choices: Sequence[Choice], prompt: int, completion: int) -> dict[str, Any]:
        out = []
        for index, c in enumerate(choices):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                choice["logprobs"] = None if c.logprobs is None else self.logprobs(c.logprobs)
            else:
                choice["text"] = c.text
                choice["logprobs"] = (
                    None if c.logprobs is None else self.logprobs(c.logprobs, c.text_offset)
                )
            choice["finish_reason"] = finish_reason(c.finish_reason)
            out.append(choice)
        return {**self._base(self.object), "choices": out, "usage": usage(prompt, completion)}

    def chunk(
        self,
        text: str | None,
        reason: str | None,
        first: bool = False,
        usage_now: tuple[int, int] | None = None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk; `usage_now` (prompt, completion tokens so far): vLLM's
        continuous_usage_stats; `logprobs`: an object from logprobs() for its tokens."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason(reason)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._base(obj), "choices": [choice]}
        if usage_now is not None:
            out["usage"] = usage(*usage_now)
        return out

    def usage_chunk(self, prompt: int, completion: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(prompt, completion)}
