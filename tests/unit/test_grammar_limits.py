"""What the server checks of a grammar before it compiles one (speedc/serve/protocol.py): $ref cycles with
nothing between are refused by name while recursive schemas (trees) pass; a grammar's text is limited;
guided_choice is one lexeme, so thousands of choices compile (a rule of alternatives put each in one parser
row: llguidance refuses over 2,000)."""

from __future__ import annotations

import pytest

from speedc.models.zoo import ZOO_DIR
from speedc.serve.protocol import MAX_GRAMMAR_BYTES, ApiError, choice_field, parse_request, ref_cycle

TREE = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
                                                                        "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}


def test_ref_cycles_are_found_and_trees_are_not():
    assert ref_cycle(TREE) is None
    assert ref_cycle({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}) == \
        ["#/$defs/a", "#/$defs/b", "#/$defs/a"]
    assert ref_cycle({"$ref": "#"}) == ["#", "#"]
    nested = {"type": "object", "properties": {"x": {"$ref": "#/definitions/x"}},
              "definitions": {"x": {"$ref": "#/definitions/x"}}}
    assert ref_cycle(nested) == ["#/definitions/x", "#/definitions/x"]
    assert ref_cycle({"$ref": "https://example.com/schema"}) is None  # not local: llguidance says what it makes of it


def test_grammar_text_is_limited_before_it_compiles():
    body = {"model": "m", "prompt": "x", "guided_choice": [f"choice number {i}" for i in range(80_000)]}
    with pytest.raises(ApiError, match="guided_choice: the grammar it makes is .* at most 1,048,576") as refused:
        parse_request(body, "completion")
    assert refused.value.code == "grammar_too_large" and refused.value.status == 400
    fits = parse_request(dict(body, guided_choice=[f"c{i}" for i in range(20_000)]), "completion")
    assert len(fits.sampling.grammar) < MAX_GRAMMAR_BYTES


def test_thousands_of_choices_compile_and_allow_exactly_them():
    """2,500 choices: the matcher takes one whole (then only the end), and refuses a string that is none of them."""
    import llguidance
    import tokenizers

    tokenizer_json = (ZOO_DIR / "tiny" / "tokenizer.json").read_text()
    encode = tokenizers.Tokenizer.from_str(tokenizer_json).encode
    end = 0
    lexicon = llguidance.LLTokenizer(tokenizer_json, n_vocab=1024, eos_token=[end])
    grammar = choice_field([f"item{i}" for i in range(2500)], "guided_choice")

    def takes(text: str) -> bool:
        matcher = llguidance.LLMatcher(lexicon, grammar, log_level=0)
        ids = encode(text, add_special_tokens=False).ids
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error()

    assert takes("item1234") and takes("item0") and takes("item2499")
    assert not takes("item2500") and not takes("itemx")
