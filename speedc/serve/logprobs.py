"""Log-probabilities in the two OpenAI shapes: completions' columns (tokens, token_logprobs,
top_logprobs as {token: logprob}, text_offset; the sampled token always among its position's top, as
OpenAI and vLLM give it) and chat's list of {token, logprob, bytes, top_logprobs}. Values come from
the engine (models/sampling.py TokenLogprob: the final head's float64 log-softmax)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table) -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    stand_ins, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_ins[chr(byte)] = byte
        else:
            stand_ins[chr(256 + extra)] = byte
            extra += 1
    return stand_ins


class TokenTexts:
    """A token id's text (what decoding it alone gives) and its bytes (a byte-level token's own bytes,
    which may be part of a UTF-8 character; else its text's UTF-8)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def bytes(self, token: int) -> list[int]:
        piece = self.tokenizer.id_to_token(token)
        if self.byte_level and token not in self.special and piece is not None:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return [alphabet[c] for c in piece]
        return list(self.text(token).encode("utf-8"))


Entry = tuple[int, object]  # (token id, its TokenLogprob, or None: the prompt's first token)


def completion_logprobs(texts: TokenTexts, entries: list[Entry], offset: int = 0) -> dict:
    """Completions' logprobs object for ENTRIES, text offsets counted from OFFSET."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in entries:
        text = texts.text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        top = {texts.text(t): value for t, value in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, entries: list[Entry]) -> dict:
    def one(token: int, value: float) -> dict:
        return {"token": texts.text(token), "logprob": value, "bytes": texts.bytes(token)}

    return {"content": [{**one(token, entry.logprob), "top_logprobs": [one(t, v) for t, v in entry.top]}
                        for token, entry in entries], "refusal": None}
