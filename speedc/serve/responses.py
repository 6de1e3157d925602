"""OpenAI response bodies and server-sent-event chunks, for completions and chat.

A stream is one id for all chunks; chat's first chunk of each choice carries the role; the last
content chunk of a choice carries its finish_reason; with stream_options.include_usage every chunk has
"usage": null and one more chunk (no choices) carries the usage; `data: [DONE]` ends it. With n > 1
the choices' chunks interleave, each naming its index.
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


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

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
        if self.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def body(self, choices: list[dict], usage_body: dict) -> dict:
        return {"id": self.id, "object": OBJECT[self.kind], "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_body, "system_fingerprint": None}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": CHUNK_OBJECT[self.kind], "created": self.created, "model": self.model,
                 "choices": choices, "system_fingerprint": None}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _delta(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
               role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def opening_events(self, choices: int = 1) -> list[str]:
        """Chat announces the role of each choice before any text; completions start with text."""
        if self.kind != "chat":
            return []
        return [event(self._chunk([self._delta(index, None, None, role=True)])) for index in range(choices)]

    def text_event(self, text: str, index: int = 0, logprobs: dict | None = None) -> str:
        return event(self._chunk([self._delta(index, text, None, logprobs)]))

    def finish_event(self, finish_reason: str, index: int = 0, logprobs: dict | None = None) -> str:
        return event(self._chunk([self._delta(index, None, finish_reason, logprobs)]))

    def closing_events(self, usage_body: dict) -> list[str]:
        events = []
        if self.include_usage:
            events.append(event({**self._chunk([]), "usage": usage_body}))
        return events + [DONE_EVENT]


def error_event(error_body: dict) -> str:
    """An error after the stream began (the status line is already sent): the openai client raises it."""
    return event(error_body)
