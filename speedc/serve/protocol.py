"""OpenAI request bodies -> checked generation parameters.

Every field a request may carry is in one of three tables: a field the server implements (with its
check), a field accepted only at its no-op value (n=1, logprobs off, no tools, ...), or nothing: an
unknown field. Anything the server would otherwise have to ignore is a 400 that names the field, so
a client never gets output that silently disregards what it asked for. `null` means "the default",
as in the OpenAI API.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from speedc.runtimes.detokenize import not_unicode

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default; chat defaults to the rest of the context


class ApiError(Exception):
    """A request the server refuses: HTTP status + the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int] | None  # completions: text, or token ids
    messages: list[dict] | None  # chat: [{"role", "content"}] with text content
    sampling: Sampling
    stream: bool
    include_usage: bool


# ---- field checks: (value, name) -> the value to use ---------------------------------------------
def _bad(name: str, what: str) -> ApiError:
    return ApiError(400, f"{name} must be {what}", param=name)


def integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer")
    return value


def number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, "a number")
    if not math.isfinite(value):  # Infinity, NaN, 1e400: refused here, naming the field (param was "prompt")
        raise _bad(name, "a finite number")
    return float(value)


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, "true or false")
    return value


def text(value: str, name: str) -> str:
    """VALUE, refused where it is not Unicode text: JSON may escape a lone surrogate ("\\ud800"), which no
    UTF-8 can hold (the tokenizer raised a TypeError: a 500 before)."""
    problem = not_unicode(value)
    if problem:
        raise ApiError(400, f"{name} is not valid Unicode text: {problem}", param=name)
    return value


def string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _bad(name, "a string")
    return text(value, name)


def stop_strings(value: Any, name: str) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise _bad(name, "a non-empty string or a list of them")
    return [text(v, name) for v in values]


def stream_options(value: Any, name: str) -> bool:
    if not isinstance(value, dict):
        raise _bad(name, "an object")
    unknown = sorted(set(value) - {"include_usage"})
    if unknown:
        raise ApiError(400, f"{name}.{unknown[0]} is not supported by this server", param=name)
    include = value.get("include_usage")
    return False if include is None else boolean(include, f"{name}.include_usage")  # null: the default


def token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise _bad(name, "a list of token ids (integers >= 0)")
    return value


def is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def prompt(value: Any, name: str) -> str | list[int]:
    """A string or a list of token ids; a batch (list of several) is not supported."""
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or is_token_ids(value[0])):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return text(value, name)
    if is_token_ids(value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise ApiError(400, f"{name}: batches of several prompts are not supported (send one request each)",
                       param=name)
    raise _bad(name, "a string or a list of token ids")


ROLES = ("system", "developer", "user", "assistant")


def message_content(value: Any, name: str) -> str:
    """Text content: a string, or a list of {"type": "text", "text": ...} parts (joined by newlines)."""
    if value is None or isinstance(value, str):
        return text(value or "", name)
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        kinds = sorted({p.get("type") for p in value} - {"text"}, key=str)
        if kinds:
            raise ApiError(400, f"{name}: content parts of type {kinds[0]!r} are not supported (text only)", param=name)
        return "\n".join(string(p.get("text"), f"{name}.text") for p in value)
    raise _bad(name, "a string or a list of text parts")


def messages(value: Any, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad(name, "a non-empty list of messages")
    try:
        return [_message(message, f"{name}[{i}]") for i, message in enumerate(value)]
    except ApiError as bad:
        bad.param = name  # the field the client sent; the message says where inside it
        raise


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise _bad(where, "an object with role and content")
    unknown = sorted(set(message) - {"role", "content", "name"})
    if unknown:
        raise ApiError(400, f"{where}.{unknown[0]} is not supported by this server (no tool calls)")
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}")
    if "content" not in message:  # null is an assistant turn without text; absent is a mistake
        raise ApiError(400, f"{where}.content is required")
    checked = {"role": role, "content": message_content(message.get("content"), f"{where}.content")}
    if message.get("name") is not None:
        checked["name"] = string(message["name"], f"{where}.name")
    return checked


# ---- the tables ----------------------------------------------------------------------------------
Check = Callable[[Any, str], Any]
COMMON: dict[str, Check] = {
    "model": string, "max_tokens": integer, "temperature": number, "top_p": number, "stop": stop_strings,
    "seed": integer, "stream": boolean, "stream_options": stream_options, "user": string,
    # not in the OpenAI API (vLLM accepts the same names as extra body fields)
    "top_k": integer, "repetition_penalty": number, "ignore_eos": boolean, "stop_token_ids": token_ids,
}
IMPLEMENTED: dict[str, dict[str, Check]] = {
    "completion": {**COMMON, "prompt": prompt},
    "chat": {**COMMON, "messages": messages, "max_completion_tokens": integer},
}
# Accepted only at the value that changes nothing; anything else asks for what the server does not do.
NO_OP_VALUES: dict[str, dict[str, tuple]] = {
    "completion": {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (0,), "suffix": ("",),
                   "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},)},
    "chat": {"n": (1,), "logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
             "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
             "function_call": ("none",), "parallel_tool_calls": (False, True), "response_format": ({"type": "text"},)},
}
REQUIRED = {"completion": ("model", "prompt"), "chat": ("model", "messages")}


def same_value(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, but 0 and 0.0 are the same number."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def read_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise ApiError(400, f"the request body is not valid JSON ({bad})") from None
    except RecursionError:  # "[" * 3000: Python's parser recurses per level (was a 500)
        raise ApiError(400, "the request body is not valid JSON here (nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse_request(body: dict, kind: str) -> ParsedRequest:
    """Check every field of an OpenAI request body (completions or chat) and gather the parameters."""
    checks, no_ops = IMPLEMENTED[kind], NO_OP_VALUES[kind]
    values: dict[str, Any] = {}
    for name, value in body.items():
        if name in checks:
            if value is not None:
                values[name] = checks[name](value, name)
        elif name in no_ops:
            if value is not None and not any(same_value(value, allowed) for allowed in no_ops[name]):
                raise ApiError(400, f"{name}={json.dumps(value)} is not supported by this server", param=name,
                               code="unsupported_parameter")
        else:
            raise ApiError(400, f"unknown parameter {name!r}", param=name, code="unknown_parameter")
    for name in REQUIRED[kind]:
        if name not in values:
            raise ApiError(400, f"{name} is required", param=name)
    stream = values.get("stream", False)
    if "stream_options" in values and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return ParsedRequest(kind=kind, model=values["model"], prompt=values.get("prompt"), messages=values.get("messages"),
                         sampling=sampling(values), stream=stream, include_usage=values.get("stream_options", False))


def sampling(values: dict[str, Any]) -> Sampling:
    max_tokens = values.get("max_completion_tokens", values.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in values else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{name} must be at least 1", param=name)
    result = Sampling(max_tokens=max_tokens, temperature=values.get("temperature", 1.0), top_p=values.get("top_p", 1.0),
                      top_k=values.get("top_k", 0), repetition_penalty=values.get("repetition_penalty", 1.0),
                      seed=values.get("seed"), stop=values.get("stop", []), ignore_eos=values.get("ignore_eos", False),
                      stop_token_ids=tuple(values.get("stop_token_ids", ())))
    for name, ok, what in (("temperature", result.temperature >= 0, ">= 0"), ("top_p", 0 < result.top_p <= 1, "in (0, 1]"),
                           ("top_k", result.top_k >= 0, ">= 0 (0 = off)"),
                           ("repetition_penalty", result.repetition_penalty > 0, "> 0"),
                           ("seed", result.seed is None or result.seed >= 0, ">= 0")):
        if not ok:
            raise _bad(name, what)
    return result
