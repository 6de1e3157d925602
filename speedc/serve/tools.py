"""Tool calls, for chat templates that write them as Hermes / Qwen templates do:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools go into the template (its `tools` variable); the output is constrained by a grammar (llguidance
Lark with the call's JSON schema: the offered names, each with its parameters): tool_choice "required" or
a named function allows only a call, "auto" a call or free text. A call the grammar let through always
parses, so the response carries it as `tool_calls` (finish_reason "tool_calls"). Templates that write calls
another way are refused: their format is not known here.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


def template_writes_calls(source: str) -> bool:
    """Whether a chat template's text writes tool calls in the format above."""
    return "<tool_call>" in source and "tools" in source


def call_schema(tools: list[dict], choice: str) -> dict:
    """The JSON schema of one call: one of the offered functions (or the one tool_choice names)."""
    functions = [t["function"] for t in tools]
    if choice.startswith("function:"):
        functions = [f for f in functions if f["name"] == choice[len("function:"):]]
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def call_grammar(tools: list[dict], choice: str) -> str:
    """llguidance's grammar for tool_choice CHOICE ("auto", "required", "function:NAME")."""
    from llguidance import LLMatcher

    call = f"start_call: {json.dumps(OPEN)} call {json.dumps(CLOSE)}\ncall: %json {json.dumps(call_schema(tools, choice))}"
    if choice == "auto":
        return LLMatcher.grammar_from_lark("start: start_call | text\ntext: /(?s:.+)/\n" + call)
    return LLMatcher.grammar_from_lark("start: start_call\n" + call)


def parse_call(text: str) -> list[dict] | None:
    """TEXT as OpenAI tool_calls when it is one call in the format above, else None (free text)."""
    if not (text.startswith(OPEN) and text.endswith(CLOSE)):
        return None
    try:
        call = json.loads(text[len(OPEN):-len(CLOSE)])
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}}]
