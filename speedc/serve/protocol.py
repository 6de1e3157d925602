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
MAX_CHOICES = 16  # n and best_of: each choice is a generation of its own in the batch
MAX_LOGPROBS = 20  # top alternatives a position may report (OpenAI's chat limit; models/sampling.py's)


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    best_of: int = 1  # completions: generations to rank by cumulative log-probability, the best n returned
    logprobs: int | None = None  # top alternatives per position (None: no log-probabilities)
    echo: bool = False  # completions: the prompt (and its log-probabilities) before the completion
    grammar: str | None = None  # llguidance's grammar the output follows (structured output)
    grammar_field: str | None = None  # the request field it came from
    depth: tuple = ()  # (name, value) of the depth settings given: loops, exit_at_step, exit_threshold, weighted_exit


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int] | None  # completions: text, or token ids
    messages: list[dict] | None  # chat: [{"role", "content"}] with text content
    sampling: Sampling
    stream: bool
    include_usage: bool
    tools: list[dict] | None = None  # chat: the function tools offered (tool_choice not "none")
    tool_choice: str = "none"  # "auto", "required", "function:NAME"


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


def logit_bias(value: Any, name: str) -> dict[int, float]:
    """{"token id": bias}: JSON keys are strings; a bias in [-100, 100] as OpenAI defines it."""
    if not isinstance(value, dict):
        raise _bad(name, 'an object of "token id": bias')
    bias = {}
    for key, amount in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ApiError(400, f"{name}: the key {key!r:.20} is not a token id", param=name)
        amount = number(amount, f"{name}[{key}]")
        if not -100 <= amount <= 100:
            raise ApiError(400, f"{name}[{key}] must be in [-100, 100]", param=name)
        bias[int(key)] = amount
    return bias


def penalty(value: Any, name: str) -> float:
    value = number(value, name)
    if not -2 <= value <= 2:
        raise _bad(name, "in [-2, 2]")
    return value


def bounded(low: int, high: int) -> Callable[[Any, str], int]:
    def check(value: Any, name: str) -> int:
        value = integer(value, name)
        if not low <= value <= high:
            raise _bad(name, f"in {low}..{high}")
        return value
    return check


# ---- structured output: each field -> llguidance's grammar string ---------------------------------
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a model cannot pad it with whitespace for ever


def _grammars():
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise ApiError(400, "structured output needs llguidance on the server: pip install 'speedc[serve]'",
                       code="unsupported_parameter") from None
    return LLMatcher


MAX_GRAMMAR_BYTES = 1 << 20  # a grammar's text (after a schema or choice list becomes one), checked before it compiles


def _resolve(schema: dict, ref: str) -> Any:
    """The part of SCHEMA a local $ref ("#/$defs/a") points at; None when it is not local or not there."""
    if not ref.startswith("#"):
        return None
    node: Any = schema
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def ref_cycle(schema: Any) -> list[str] | None:
    """A chain of $refs that comes back to where it began with nothing between (a -> b -> a): a schema that no
    value can satisfy, which llguidance would take and then allow no output. (A recursive schema whose $ref
    sits inside an object or array, a tree, is fine: each level writes something.)"""
    if not isinstance(schema, dict):
        return None
    stack, seen_nodes = [schema], set()
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, dict):
            chain, here = [], node
            while isinstance(here, dict) and isinstance(here.get("$ref"), str):
                ref = here["$ref"]
                if ref in chain:
                    return chain[chain.index(ref):] + [ref]
                chain.append(ref)
                here = _resolve(schema, ref)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return None


def _json_grammar(schema: Any, name: str) -> str:
    if not isinstance(schema, (dict, bool)):
        raise _bad(name, "a JSON schema (an object)")
    cycle = ref_cycle(schema)
    if cycle is not None:
        raise ApiError(400, f"{name}: $ref cycle {' -> '.join(cycle)}: no value can satisfy it", param=name,
                       code="invalid_grammar")
    try:
        return _grammars().grammar_from_json_schema(schema if isinstance(schema, dict) else {},
                                                    overrides=JSON_OPTIONS)
    except ValueError as bad:
        raise ApiError(400, f"{name} is not a JSON schema this server can follow: {bad}", param=name) from None


def response_format(value: Any, name: str) -> str | None:
    """OpenAI's response_format: text (None), json_object (any JSON object), json_schema."""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad(name, 'an object with "type": "text", "json_object" or "json_schema"')
    kind = value["type"]
    unknown = sorted(set(value) - {"type", "json_schema"})
    if unknown:
        raise ApiError(400, f"{name}.{unknown[0]} is not supported by this server", param=name)
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"}, name)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _bad(f"{name}.json_schema", 'an object with a "name" (and a "schema")')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ApiError(400, f"{name}.json_schema.{unknown[0]} is not supported by this server", param=name)
    return _json_grammar(spec.get("schema", {}), f"{name}.json_schema.schema")


def json_schema_field(value: Any, name: str) -> str:
    """vLLM's guided_json, llama-server's json_schema: a schema (or its JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as bad:
            raise ApiError(400, f"{name} is not JSON: {bad}", param=name) from None
    return _json_grammar(value, name)


def regex_field(value: Any, name: str) -> str:
    return _grammars().grammar_from_regex(string(value, name))


def choice_field(value: Any, name: str) -> str:
    """vLLM's guided_choice: the output is one of these strings."""
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _bad(name, "a non-empty list of non-empty strings")
    # one lexeme of alternatives: the lexer matches them as a trie (100,000 compile in ~0.5 s), where a rule of
    # alternatives puts each in one parser row (llguidance refuses a row of over 2,000 items)
    return _grammars().grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(text(v, name)) for v in value))


def grammar_field(value: Any, name: str) -> str:
    """A context-free grammar: Lark (vLLM's guided_grammar, llguidance's syntax) or GBNF (llama-server's
    grammar), told apart by their syntax."""
    _grammars()
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return _grammars().grammar_from_lark(any_to_lark(string(value, name)))
    except Exception as bad:  # the GBNF converter raises its own errors on text it cannot read
        raise ApiError(400, f"{name} is not a grammar this server can read: {bad}", param=name) from None


GRAMMAR_FIELDS = {"response_format": response_format, "guided_json": json_schema_field, "json_schema": json_schema_field,
                  "guided_regex": regex_field, "guided_choice": choice_field, "guided_grammar": grammar_field,
                  "grammar": grammar_field}


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


ROLES = ("system", "developer", "user", "assistant", "tool")


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
    unknown = sorted(set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"})
    if unknown:
        raise ApiError(400, f"{where}.{unknown[0]} is not supported by this server")
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}")
    if "content" not in message:  # null is an assistant turn without text; absent is a mistake
        raise ApiError(400, f"{where}.content is required")
    checked = {"role": role, "content": message_content(message.get("content"), f"{where}.content")}
    if message.get("name") is not None:
        checked["name"] = string(message["name"], f"{where}.name")
    if message.get("tool_call_id") is not None:
        checked["tool_call_id"] = string(message["tool_call_id"], f"{where}.tool_call_id")
    if message.get("tool_calls") is not None:
        checked["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return checked


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant turn's calls, for the template: arguments as an object (the JSON text OpenAI sends
    parsed, as chat templates expect it)."""
    if not isinstance(value, list):
        raise _bad(where, "a list of tool calls")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}[{i}]", 'an object with "function": {"name", "arguments"}')
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise ApiError(400, f"{where}[{i}].function.arguments is not JSON") from None
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def tools(value: Any, name: str) -> list[dict]:
    """Function tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(value, list):
        raise _bad(name, "a list of tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, f'{name}[{i}] must be an object with "type": "function" and "function": '
                                '{"name", ...}', param=name)
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, f"{name}[{i}].function.parameters must be a JSON schema (an object)", param=name)
    return value


def tool_choice(value: Any, name: str) -> str:
    """"none", "auto", "required", or {"type": "function", "function": {"name"}}: the name then."""
    if value in ("none", "auto", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str) and value.get("type") == "function":
        return "function:" + function["name"]
    raise _bad(name, '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


# ---- the tables ----------------------------------------------------------------------------------
Check = Callable[[Any, str], Any]
COMMON: dict[str, Check] = {
    "model": string, "max_tokens": integer, "temperature": number, "top_p": number, "stop": stop_strings,
    "seed": integer, "stream": boolean, "stream_options": stream_options, "user": string,
    # not in the OpenAI API (vLLM accepts the same names as extra body fields)
    "top_k": integer, "repetition_penalty": number, "ignore_eos": boolean, "stop_token_ids": token_ids,
    "presence_penalty": penalty, "frequency_penalty": penalty, "logit_bias": logit_bias, "n": bounded(1, MAX_CHOICES),
    **GRAMMAR_FIELDS,
    # a looped model's own depth rules (Ouro's forward arguments; the engine checks them against the artifact)
    "loops": integer, "exit_at_step": integer, "exit_threshold": number, "weighted_exit": boolean,
}
DEPTH_FIELDS = ("loops", "exit_at_step", "exit_threshold", "weighted_exit")
IMPLEMENTED: dict[str, dict[str, Check]] = {
    "completion": {**COMMON, "prompt": prompt, "logprobs": bounded(0, MAX_LOGPROBS), "echo": boolean,
                   "best_of": bounded(1, MAX_CHOICES)},
    "chat": {**COMMON, "messages": messages, "max_completion_tokens": integer, "logprobs": boolean,
             "top_logprobs": bounded(0, MAX_LOGPROBS), "tools": tools, "tool_choice": tool_choice,
             "parallel_tool_calls": boolean},
}
# Accepted only at the value that changes nothing; anything else asks for what the server does not do.
NO_OP_VALUES: dict[str, dict[str, tuple]] = {
    "completion": {"suffix": ("",)},
    "chat": {"functions": ([],), "function_call": ("none",)},
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
    grammars = [name for name in GRAMMAR_FIELDS if values.get(name) is not None]
    if len(grammars) > 1:
        raise ApiError(400, f"{grammars[0]} and {grammars[1]}: give one way of constraining the output", param=grammars[1])
    parsed = sampling(values, kind)
    offered, choice = values.get("tools") or None, values.get("tool_choice", "auto" if values.get("tools") else "none")
    if choice != "none" and not offered:
        raise ApiError(400, f"tool_choice {choice.split(':')[0]!r} needs tools", param="tool_choice")
    if choice != "none":
        if grammars:
            raise ApiError(400, f"tools and {grammars[0]}: give one way of constraining the output", param=grammars[0])
        if stream:
            raise ApiError(400, "streaming tool calls is not supported (send stream: false)", param="tools")
        if choice.startswith("function:") and choice[9:] not in {t["function"]["name"] for t in offered}:
            raise ApiError(400, f"tool_choice names {choice[9:]!r}, which is not among the tools", param="tool_choice")
    if parsed.best_of > parsed.n and stream:
        raise ApiError(400, "best_of > n cannot stream (the best are known only at the end)", param="best_of")
    return ParsedRequest(kind=kind, model=values["model"], prompt=values.get("prompt"), messages=values.get("messages"),
                         sampling=parsed, stream=stream, include_usage=values.get("stream_options", False),
                         tools=offered if choice != "none" else None, tool_choice=choice)


def logprobs_asked(values: dict[str, Any], kind: str) -> int | None:
    """Top alternatives per position (None: no log-probabilities): completions' logprobs is the count;
    chat's logprobs is a switch and top_logprobs the count."""
    if kind == "completion":
        return values.get("logprobs")
    if "top_logprobs" in values and not values.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return values.get("top_logprobs", 0) if values.get("logprobs") else None


def sampling(values: dict[str, Any], kind: str = "completion") -> Sampling:
    max_tokens = values.get("max_completion_tokens", values.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in values else "max_tokens"
    echo = values.get("echo", False)
    if max_tokens is not None and max_tokens < (0 if echo else 1):  # 0 with echo: score the prompt alone
        raise ApiError(400, f"{name} must be at least 1" + ("" if kind == "chat" else " (0 only with echo)"), param=name)
    n = values.get("n", 1)
    best_of = values.get("best_of", n)
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    result = Sampling(max_tokens=max_tokens, temperature=values.get("temperature", 1.0), top_p=values.get("top_p", 1.0),
                      top_k=values.get("top_k", 0), repetition_penalty=values.get("repetition_penalty", 1.0),
                      seed=values.get("seed"), stop=values.get("stop", []), ignore_eos=values.get("ignore_eos", False),
                      stop_token_ids=tuple(values.get("stop_token_ids", ())),
                      presence_penalty=values.get("presence_penalty", 0.0),
                      frequency_penalty=values.get("frequency_penalty", 0.0), logit_bias=values.get("logit_bias"),
                      n=n, best_of=best_of, logprobs=logprobs_asked(values, kind), echo=echo,
                      grammar=next((values[name] for name in GRAMMAR_FIELDS if values.get(name) is not None), None),
                      grammar_field=next((name for name in GRAMMAR_FIELDS if values.get(name) is not None), None),
                      depth=tuple((name, values[name]) for name in DEPTH_FIELDS if name in values))
    if result.grammar is not None and len(result.grammar) > MAX_GRAMMAR_BYTES:
        raise ApiError(400, f"{result.grammar_field}: the grammar it makes is {len(result.grammar):,} characters; this "
                            f"server compiles at most {MAX_GRAMMAR_BYTES:,}", param=result.grammar_field,
                       code="grammar_too_large")
    for name, ok, what in (("temperature", result.temperature >= 0, ">= 0"), ("top_p", 0 < result.top_p <= 1, "in (0, 1]"),
                           ("top_k", result.top_k >= 0, ">= 0 (0 = off)"),
                           ("repetition_penalty", result.repetition_penalty > 0, "> 0"),
                           ("seed", result.seed is None or result.seed >= 0, ">= 0")):
        if not ok:
            raise _bad(name, what)
    return result
