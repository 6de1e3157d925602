"""IncrementalText (runtimes/detokenize.py): the text of ids fed one at a time equals a whole decode of
them after every id, under the decoder families (byte-level BPE: the zoo and Qwen/Llama-3 style;
SentencePiece-style Metaspace + byte fallback + strip: Llama 2 style; Metaspace alone; no decoder;
WordPiece with cleanup), with random ids (special tokens, split and invalid UTF-8 included) and stop
strings; a stream never takes back text it showed; and each id costs a bounded decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from conftest import ZOO
from speedc.runtimes.detokenize import DecodeRule, IncrementalText, StopStrings, cut_at_stop, decode_rule


def _sentencepiece_style() -> Tokenizer:
    """Llama-2-like: BPE with byte fallback, "▁" for spaces, the first leading space stripped."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "e", "l", "o", "h", "a", "n", "t", "\n", "▁h", "he", "ll", "lo", "▁a", "an", "▁the", "é", "ö"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h"), ("h", "e"), ("l", "l"), ("l", "o"), ("▁", "a"),
                                                           ("a", "n")], byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tokenizer


def _word_level(decoder) -> Tokenizer:
    """Whole words with "▁" for the space before them, a special token decode leaves out."""
    words = ["<unk>", "▁Hello", "▁world", "Hello", ",", "▁a", "é", "▁é", "\n", "▁", "ö"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken("<sp>", special=True)])
    tokenizer.decoder = decoder
    return tokenizer


def _wordpiece_with_cleanup() -> Tokenizer:
    """BERT-like: "##" continuations, and cleanup that joins " ." and " n't" to the word before."""
    pieces = ["[UNK]", "hello", "##lo", "do", "n't", "'", "s", ".", ",", "a", "##b", "?", "the", "##é"]
    tokenizer = Tokenizer(models.WordPiece(vocab={p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tokenizer


TOKENIZERS = {
    "zoo-byte-level-bpe": lambda: Tokenizer.from_file(str(ZOO / "tiny" / "tokenizer.json")),
    "sentencepiece-style": _sentencepiece_style,
    "metaspace-first": lambda: _word_level(decoders.Metaspace(prepend_scheme="first")),
    "no-decoder": lambda: _word_level(None),
    "wordpiece-cleanup": _wordpiece_with_cleanup,
}
STOPS = ["\n\n", "e", "ll", "é", " a", "the", "n't", "\ufffd", "lo.", "ö"]


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request) -> Tokenizer:
    return TOKENIZERS[request.param]()


def _decoder_keeps_its_text(tokenizer: Tokenizer, ids: list[int]) -> bool:
    """Whether each prefix's decode (less an incomplete character at its end) begins every longer one's.
    Not always so: byte fallback re-renders a valid byte token as U+FFFD once an invalid one follows it,
    and WordPiece cleanup turns "a ' s" into "a's"; no stream can show such text and never take it back."""
    texts = [tokenizer.decode(ids[:k]).rstrip("\ufffd") for k in range(1, len(ids) + 1)]
    return all(longer.startswith(shorter) for shorter, longer in zip(texts, texts[1:]))


def _check_every_prefix(tokenizer: Tokenizer, ids: list[int], stop: list[str]) -> None:
    rule = decode_rule(tokenizer)
    text = IncrementalText(tokenizer.decode, stop, rule)
    keeps_its_text = _decoder_keeps_its_text(tokenizer, ids)
    shown = ""
    for k, token in enumerate(ids, 1):
        text.push(token)
        whole = tokenizer.decode(ids[:k])
        # a U+FFFD at the end may be a character's first byte: no stop string ends there yet
        assert text.stopped == any(s in whole.rstrip("\ufffd") for s in stop), (ids[:k], stop)
        assert text.text == (cut_at_stop(whole, stop) if text.stopped else whole), (ids[:k], stop)
        shown += text.take_settled()
        assert text.shown == len(shown)
        if rule.windowed or keeps_its_text:  # a stream never takes text back
            assert text.text.startswith(shown), (ids[:k], shown, whole)
        if text.stopped:  # generation ends at the first stop string
            break
    assert not (rule.windowed or keeps_its_text) or text.text.startswith(shown)


@settings(max_examples=int(__import__("os").environ.get("DETOK_EX", "150")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_equals_a_whole_decode_after_every_id(tokenizer, data):
    vocab = tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), label="ids")
    stop = data.draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True), label="stop")
    _check_every_prefix(tokenizer, ids, stop)


def test_real_text_and_split_characters(tokenizer):
    """Text the tokenizer itself produced (words, newlines, accents split over byte tokens)."""
    ids = tokenizer.encode("hello the an\n\nhé ö lo. don't a ll é\n").ids * 3
    for stop in ([], ["\n\n"], ["é"], ["ll", "ö"]):
        _check_every_prefix(tokenizer, ids, stop)


def test_decoders_are_windowed_only_where_that_is_exact():
    assert decode_rule(TOKENIZERS["zoo-byte-level-bpe"]()) == DecodeRule(skipped=frozenset({0}))  # <|endoftext|>
    sentencepiece = decode_rule(TOKENIZERS["sentencepiece-style"]())
    assert sentencepiece.windowed and len(sentencepiece.byte_tokens) == 256 and len(sentencepiece.skipped) == 2
    assert decode_rule(TOKENIZERS["wordpiece-cleanup"]()) == DecodeRule(windowed=False)


@pytest.mark.parametrize("name", ["zoo-byte-level-bpe", "sentencepiece-style"])
def test_each_id_costs_a_bounded_decode(name):
    """The streams and the stop rule decoded the whole output after every id (O(n^2) over a generation):
    now the ids decoded per id stay bounded however long the text grows."""
    tokenizer = TOKENIZERS[name]()
    special = sorted(decode_rule(tokenizer).skipped)[0]  # a run of them (end-of-text under --ignore-eos) too
    ids = tokenizer.encode("ROMEO: I will not be a banish'd, nor é ö.\n\nhello the an\n" * 40).ids + [special] * 500 \
        + tokenizer.encode(" and after").ids
    decoded = []

    def decode(some: list[int]) -> str:
        decoded.append(len(some))
        return tokenizer.decode(some)

    text = IncrementalText(decode, ["never there"], decode_rule(tokenizer))
    for token in ids:
        text.push(token)
        text.take_settled()
    assert len(ids) > 1000
    assert max(decoded) <= 16 and sum(decoded) <= 8 * len(ids)
    assert text.text == tokenizer.decode(ids) and not text.stopped


def test_stop_rule_starts_over_for_another_generation():
    tokenizer = TOKENIZERS["zoo-byte-level-bpe"]()
    first, second = tokenizer.encode("hello there\n\nend").ids, tokenizer.encode("no stop here").ids
    rule = StopStrings(tokenizer.decode, ["\n\n"])
    growing, said = [], []
    for token in first:
        growing.append(token)
        said.append(rule(growing))
    at = said.index(True)  # the first id whose text completes the stop string, and every one after it
    assert all(said[at:]) and "\n\n" in tokenizer.decode(first[:at + 1]) and "\n\n" not in tokenizer.decode(first[:at])
    growing = []
    for token in second:  # another list, fed as a generation feeds it
        growing.append(token)
        assert not rule(growing)  # not the first text's stop
    assert rule(list(first))  # a whole list at once: decoded from the start
