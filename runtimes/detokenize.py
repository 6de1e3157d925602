"""Text of a growing list of token ids, a token at a time, at a cost per token that does not grow
with the text: the streams and the stop-string rule used to re-decode the whole output after every
token (1 ms a token at 4,000 tokens with the zoo tokenizer, twice a token with stop strings: O(n^2)
over a long generation, on the server's event loop for every stream).

    ids:   t0 t1 t2 ... t(p-1) | tp ... t(r-1) | tr ... t(n-1)
           committed text ......|   window     |  pending
                                ^ prefix        ^ read

Only the window and the pending ids are decoded each token: pending text = decode(ids[prefix:]) minus
decode(ids[prefix:read]). The window gives the pending ids their left context (SentencePiece's
leading-space rules look at the token before). Pending text is committed once it is not empty (a
special token alone decodes to nothing: a window of it would hide the context) and ends in a whole
character (not U+FFFD, an incomplete UTF-8 sequence); then the window moves up to the old read offset.
Streams show committed text only (take_settled).

That is exact only where a token's text never changes once later tokens follow (decode_rule):
byte-level BPE (GPT-2, Llama 3, Qwen, the zoo), Metaspace and Replace/Strip/Fuse. Byte fallback
(Llama 2, Mistral) re-renders a run of <0xNN> tokens as U+FFFD when a later byte makes the run
invalid UTF-8, so text is not committed while the last id that shows text is a byte token. WordPiece
cleanup and CTC rewrite across tokens (" ' s" -> "'s"), and unknown decoders might: those decode the
whole text each time, as before (exact, O(n) a token). A window whose text is not a prefix of the
longer decode switches to whole decoding too. A window waiting for a whole character (a run of
invalid bytes, or a genuine U+FFFD at the end) grows until one comes.

Stop strings are looked for only in the new text plus the last len(longest stop) - 1 characters
before it, so the first occurrence found is the first in the whole text (Engine.trim's cut). A U+FFFD
at the very end is left out of the search: it may be the first byte of a character the next token
completes (a stop string "\ufffd" ended generations on characters that never appeared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

REPLACEMENT = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence
LOCAL_DECODERS = {"ByteLevel", "Metaspace", "Fuse", "Strip", "ByteFallback", "BPEDecoder"}  # see the module doc


@dataclass(frozen=True)
class DecodeRule:
    """How a tokenizer's text may be decoded a window at a time (decode_rule)."""
    windowed: bool = True  # False: decode all ids each time
    byte_tokens: frozenset[int] = frozenset()  # byte-fallback ids: text not committed while the last one showing text is one
    skipped: frozenset[int] = frozenset()  # special ids decode leaves out: never decoded (nor part of a byte run)


@dataclass(frozen=True)
class Piece:
    """A stretch of one request's streamed output: the confirmed token ids it adds, in order, and the
    settled text they complete ("" while a UTF-8 character is incomplete, a stop string cut it, or there
    is no tokenizer). The batching loop gives one id a piece; the single-sequence server stream as many
    as one settled text spans. No ids: text held back to the end (it might have begun a stop string)."""
    ids: tuple[int, ...]
    text: str


def _local(decoder: dict | None) -> bool:
    if decoder is None:  # tokens joined by spaces
        return True
    kind = decoder.get("type")
    if kind == "Sequence":
        return all(_local(part) for part in decoder.get("decoders", []))
    if kind == "Replace":  # a one-character pattern cannot span two tokens' text
        return len(next(iter(decoder.get("pattern", {}).values()), "")) == 1
    if kind == "WordPiece":
        return not decoder.get("cleanup", True)
    return kind in LOCAL_DECODERS


def _mentions(decoder: dict | None, kind: str) -> bool:
    return decoder is not None and (decoder.get("type") == kind or any(_mentions(d, kind) for d in decoder.get("decoders", [])))


def decode_rule(tokenizer) -> DecodeRule:
    """The DecodeRule of a `tokenizers.Tokenizer`, read from its decoder's own description."""
    if not hasattr(tokenizer, "decoder"):  # not a tokenizers.Tokenizer: nothing known of its decoding
        return DecodeRule(windowed=False)
    try:
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else None
    except (AttributeError, TypeError, ValueError):
        return DecodeRule(windowed=False)
    if not _local(decoder):
        return DecodeRule(windowed=False)
    added = getattr(tokenizer, "get_added_tokens_decoder", dict)()
    skipped = frozenset(i for i, token in added.items() if token.special)
    if _mentions(decoder, "ByteFallback"):
        found = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return DecodeRule(byte_tokens=frozenset(i for i in found if i is not None), skipped=skipped)
    return DecodeRule(skipped=skipped)


def not_unicode(text: str) -> str | None:
    """Why TEXT is not Unicode text (a lone surrogate: no UTF-8 holds it, and the tokenizer raises a
    TypeError), or None: a JSON "\\udce9" escape, or a byte that was not UTF-8 in a command-line argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        code = ord(text[bad.start])
        byte = f", the byte 0x{code - 0xDC00:02x} that is not UTF-8" if 0xDC80 <= code <= 0xDCFF else ""
        return f"a lone surrogate U+{code:04X} at character {bad.start}{byte}"
    return None


def stop_prefix_length(text: str, stop: list[str]) -> int:
    """Length of the longest end of TEXT that begins some stop string (0 when none does)."""
    for length in range(min(len(text), max(map(len, stop), default=1) - 1), 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return length
    return 0


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    """TEXT cut before the first stop string in it."""
    if not stop:
        return text
    return text[:min((text.index(s) for s in stop if s in text), default=len(text))]


class IncrementalText:
    """The text of ids fed one at a time (`push`), equal to DECODE(all ids) with stop strings cut.

    `text` is the text so far (pending ids included, as a whole decode shows it; O(n): for the end and
    for tests), `stopped` whether a stop string occurs in it, `take_settled()` the text a stream may
    show since its last call: never an incomplete character, never text that may still begin a stop
    string, never text a later id could re-render; `shown` how many characters it has handed out."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None,
                 rule: DecodeRule = DecodeRule()) -> None:
        """DECODE: ids -> text, leaving out special ids (tokenizers' default) as RULE.skipped lists them."""
        self._decode, self._byte_tokens, self._skipped = decode, rule.byte_tokens, rule.skipped
        self.stop = list(stop or [])
        self._longest = max(map(len, self.stop), default=0)
        self.ids: list[int] = []
        self._visible: list[int] = []  # ids less the skipped ones (a run of end-of-text ids under
        # --ignore-eos would otherwise grow the window: O(run) a token); the offsets below index it
        self._pieces: list[str] = []  # committed text (of ids[:_read]), in pieces
        self._length = 0  # its length
        self._tail = ""  # its last _longest - 1 characters: where a stop may begin
        self._unshown = ""  # its end that take_settled has not handed out
        self._prefix = self._read = 0  # window ids[_prefix:_read]
        self._window_text = ""  # decode(ids[_prefix:_read])
        self._pending = ""  # text of ids[_read:], possibly ending in an incomplete character; all of it when whole
        self._whole = not rule.windowed  # decode everything each time
        self.shown = 0  # characters take_settled and take_rest have handed out
        self.stop_at: int | None = None  # index in the text of the first stop string, once one occurs

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    @property
    def text(self) -> str:
        """The text of every id pushed, cut before the first stop string."""
        whole = "".join(self._pieces) + self._pending
        return whole if self.stop_at is None else whole[:self.stop_at]

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token in self._skipped:  # decode leaves it out: the text is what it was
            return
        self._visible.append(token)
        if self._whole:
            self._pending = self._decode(self._visible)
            self._look_for_stop(self._pending.rstrip(REPLACEMENT), 0)
            return
        extended = self._decode(self._visible[self._prefix:])
        if not extended.startswith(self._window_text):
            self._switch_to_whole()
            return
        self._pending = extended[len(self._window_text):]
        self._look_for_stop(self._tail + self._pending.rstrip(REPLACEMENT), self._length - len(self._tail))
        if self._pending and not self._pending.endswith(REPLACEMENT) and not self._in_byte_run():
            self._commit()

    def _in_byte_run(self) -> bool:
        """Whether the last pending id is a byte-fallback token (committed text never ends in one, so a
        run of them lies in the pending ids; skipped ids are not in _visible)."""
        return bool(self._byte_tokens) and self._visible[-1] in self._byte_tokens

    def _commit(self) -> None:
        """The pending text is final: it joins the committed text; the window moves."""
        piece = self._pending
        self._pieces.append(piece)
        self._length += len(piece)
        self._unshown += piece
        self._tail = (self._tail + piece)[-(self._longest - 1):] if self._longest > 1 else ""
        self._prefix, self._read = self._read, len(self._visible)
        self._window_text = self._decode(self._visible[self._prefix:self._read])
        self._pending = ""

    def _switch_to_whole(self) -> None:
        self._whole = True
        self._pieces, self._length, self._tail, self._unshown, self.stop_at = [], 0, "", "", None
        self._pending = self._decode(self._visible)
        self._look_for_stop(self._pending.rstrip(REPLACEMENT), 0)

    def _look_for_stop(self, region: str, offset: int) -> None:
        """REGION: the text from index OFFSET on, holding every place a new stop string could be."""
        if not self.stop or self.stop_at is not None:
            return
        first = min((i for i in (region.find(s) for s in self.stop) if i >= 0), default=None)
        if first is not None:
            self.stop_at = offset + first

    def take_settled(self) -> str:
        """The text a stream may show now that it has not been handed yet. Nothing once a stop string
        occurred: the stream's end shows the text up to it (a whole decode, exactly generate()'s)."""
        if self.stop_at is not None:
            return ""
        if self._whole:  # the rule streams always had: nothing while the text ends in an incomplete character
            text = self._pending
            if text.endswith(REPLACEMENT):
                return ""
            end = len(text) - stop_prefix_length(text, self.stop)
            piece = text[self.shown:end] if end > self.shown else ""
        else:
            keep = stop_prefix_length(self._tail, self.stop)  # the committed end that may begin a stop
            piece = self._unshown[:len(self._unshown) - keep]
            self._unshown = self._unshown[len(piece):]
        self.shown += len(piece)
        return piece

    def take_rest(self, final: str) -> str:
        """The end of FINAL (the generation's whole text, stop strings cut: one whole decode, exactly
        generate()'s) that take_settled has not handed out: what a stream shows last."""
        rest = final[self.shown:] if len(final) > self.shown else ""
        self.shown += len(rest)
        return rest


class StopStrings:
    """A request's stop-string rule: called with its list of generated ids after each new one, True
    once their text contains a stop string. Fed one id a call (IncrementalText); called with another
    list, or with more than one new id, it starts over from that list."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], rule: DecodeRule = DecodeRule()) -> None:
        self._decode, self._stop, self._rule = decode, stop, rule
        self._text = IncrementalText(decode, stop, rule)
        self._ids: list[int] | None = None  # the list it is following

    def __call__(self, ids: list[int]) -> bool:
        if ids is not self._ids or len(ids) != len(self._text.ids) + 1:
            self._ids, self._text = ids, IncrementalText(self._decode, self._stop, self._rule)
            for token in ids[:-1]:
                self._text.push(token)
        self._text.push(ids[-1])
        return self._text.stopped
