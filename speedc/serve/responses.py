"""OpenAI response bodies and server-sent-event chunks, for completions and chat.

A stream is one id for all chunks; chat's first chunk carries the role; the last content chunk
carries finish_reason; with stream_options.include_usage every chunk has "usage": null and one more
chunk (no choices) carries the usage; `data: [DONE]` ends it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

DONE_EVENT = "data: [DONE]\n\n"
ID_PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-"}
OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Reply:
    """What every body and chunk of one response shares."""
    kind: str  # "completion" or "chat"
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ID_PREFIX[self.kind] + uuid.uuid4().hex

    def body(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": OBJECT[self.kind], "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": CHUNK_OBJECT[self.kind], "created": self.created, "model": self.model,
                 "choices": choices, "system_fingerprint": None}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def opening_events(self) -> list[str]:
        """Chat announces the role before any text; completions start with text."""
        return [event(self._chunk([self._choice(None, None, role=True)]))] if self.kind == "chat" else []

    def text_event(self, text: str) -> str:
        return event(self._chunk([self._choice(text, None)]))

    def closing_events(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> list[str]:
        events = [event(self._chunk([self._choice(None, finish_reason)]))]
        if self.include_usage:
            events.append(event({**self._chunk([]), "usage": usage(prompt_tokens, completion_tokens)}))
        return events + [DONE_EVENT]


def error_event(error_body: dict) -> str:
    """An error after the stream began (the status line is already sent): the openai client raises it."""
    return event(error_body)
