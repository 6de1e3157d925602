"""A caller's prompt and settings -> a checked Request for one artifact (runtimes/decode.py): ids inside the
vocabulary, limits inside the context, its own TokenPicker (sampling, log-probabilities, a grammar) and its
stop rule. Every check raises GenerationError with one line, before anything is queued. The Engine holds one
(Engine.requests) and answers its make_request / encode / end_ids / grammar_constraint with it."""

from __future__ import annotations

import threading
from pathlib import Path

from speedc.errors import GenerationError
from speedc.models.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenPicker, is_integer, require
from speedc.runtimes.decode import Request
from speedc.runtimes.detokenize import DecodeRule, StopStrings, not_unicode
from speedc.runtimes.exit_rule import SETTINGS as DEPTH_SETTINGS, DepthRules

# generate()'s keyword arguments a request is made of (Engine.request_from)
SETTINGS = frozenset({"max_new_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty", "stop",
                      "stop_at_eos", "early_flush", "stop_token_ids", "presence_penalty", "frequency_penalty",
                      "logit_bias", "logprobs", "prompt_logprobs", "grammar", *DEPTH_SETTINGS})


def sampling_params(temperature, top_k, top_p, repetition_penalty, seed, presence_penalty=0.0, frequency_penalty=0.0,
                    logit_bias=None, logprobs=None) -> SamplingParams:
    """SamplingParams from generate()'s keyword arguments (LOGIT_BIAS: {token id: bias})."""
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise GenerationError(f"logit_bias must be a dict of token id -> bias, not {type(logit_bias).__name__}")
    bad = next((key for key in logit_bias or {} if not is_integer(key)), None)
    if bad is not None:
        raise GenerationError(f"logit_bias keys must be token ids (integers), not {bad!r:.20}")
    bias = tuple(sorted((logit_bias or {}).items()))
    return SamplingParams(temperature, top_k, top_p, repetition_penalty, seed, presence_penalty, frequency_penalty,
                          bias, logprobs)


def check_text(text: str, what: str) -> None:
    """GenerationError where TEXT is not Unicode text (detokenize.not_unicode)."""
    problem = not_unicode(text)
    if problem:
        raise GenerationError(f"{what} is not valid Unicode text: {problem}")


class RequestChecks:
    """DIMS: the manifest's model sizes (vocabulary, context, end-of-text ids); TOKENIZER: the artifact's (None
    where it has none), TOKENIZER_FILE its tokenizer.json (a grammar's tokenizer is built from it once);
    DEPTH_RULES: the loops and exit rules the artifact allows a request."""

    def __init__(self, dims, tokenizer, tokenizer_file: Path, decode_rule: DecodeRule, depth_rules: DepthRules) -> None:
        self.dims, self.tokenizer, self.tokenizer_file, self.decode_rule = dims, tokenizer, tokenizer_file, decode_rule
        self.depth_rules = depth_rules
        self._grammar_tokenizer = None
        self._lock = threading.Lock()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError("this artifact has no tokenizer.json: pass token ids instead of text")
            check_text(prompt, "the prompt")
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):  # bytes would run as ids
            raise GenerationError(f"a prompt is text (str) or a list of token ids, not {type(prompt).__name__}")
        else:
            ids = list(prompt)
            bad = next((i for i in ids if not is_integer(i)), None)
            if bad is not None:  # int() would turn 1.7 into 1 and "5" into 5
                raise GenerationError(f"prompt ids must be integers, not {type(bad).__name__} ({bad!r:.20})")
            ids = [int(i) for i in ids]
        if not ids:
            raise GenerationError("empty prompt: give at least one token")
        vocab = self.dims.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise GenerationError(f"prompt id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def make(self, prompt, max_new_tokens: int, sampling: SamplingParams, stop: list[str] | None, stop_at_eos: bool,
             stop_token_ids=None, prompt_logprobs: int | None = None, grammar=None, depth: dict | None = None) -> Request:
        """A checked request: ids, limits, its own TokenPicker, stop rule. STOP_TOKEN_IDS: ids that end the
        generation as an end-of-text id does (a chat template's end of turn), even with stop_at_eos off.
        PROMPT_LOGPROBS: record the prompt's own log-probabilities with this many top alternatives (the prompt
        then prefills a token a run). GRAMMAR: an llguidance grammar (runtimes/constraint.py; e.g.
        llguidance.LLMatcher.grammar_from_json_schema(schema)) the output follows, ending at an end id
        (stop_at_eos's or STOP_TOKEN_IDS), or one compiled by grammar_constraint. DEPTH: loops / exit_at_step /
        exit_threshold / weighted_exit (runtimes/exit_rule.py), as the artifact allows."""
        max_new_tokens = self._check_limits(max_new_tokens, stop_at_eos, stop, prompt_logprobs)
        rule = self.depth_rules.rule(**(depth or {}))
        if rule is not None and not rule.recurrent and prompt_logprobs is not None:  # (a count's prefill reads out at it)
            raise GenerationError("prompt logprobs are the full depth's: they cannot be asked with an exit rule or an "
                                  "Ouro-like loop count")
        ids = self.encode(prompt)
        vocab = self.dims.vocab_size
        bad = next((i for i, _ in sampling.logit_bias if not 0 <= i < vocab), None)
        if bad is not None:
            raise GenerationError(f"logit bias: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        limit = self.dims.max_context
        if len(ids) + max_new_tokens > limit:
            raise GenerationError(f"prompt ({len(ids)} tokens) + max new tokens ({max_new_tokens}) exceeds the "
                                  f"model's context of {limit}")
        eos = self.end_ids(stop_at_eos, stop_token_ids)
        stop_strings = StopStrings(self.tokenizer.decode, stop, self.decode_rule) if stop else None

        def stop_reason(new_ids: list[int]) -> str | None:
            if new_ids[-1] in eos:
                return "eos"
            if stop_strings is not None and stop_strings(new_ids):
                return "stop_string"
            return None

        constraint = self.grammar_constraint(grammar, eos) if grammar is not None else None
        return Request(ids, max_new_tokens, TokenPicker(sampling, constraint), stop_reason, prompt_logprobs=prompt_logprobs,
                       depth_rule=rule)

    def _check_limits(self, max_new_tokens, stop_at_eos, stop, prompt_logprobs) -> int:
        """make's settings that need no prompt: max new tokens (-> as an int), the stop rule, prompt logprobs."""
        require(max_new_tokens, "max new tokens", "an integer")
        max_new_tokens = int(max_new_tokens)  # a numpy integer would reach the pool's sizes (int.bit_length)
        if max_new_tokens < 1:
            raise GenerationError("max new tokens must be at least 1")
        if not isinstance(stop_at_eos, bool):
            raise GenerationError(f"stop_at_eos must be True or False, not {type(stop_at_eos).__name__}")
        if stop is not None and not isinstance(stop, (list, tuple)):  # a str: it would stop at any one character
            example = f"stop=[{stop!r}]" if isinstance(stop, str) else "stop=['\\n\\n']"
            raise GenerationError(f"stop must be a list of strings, e.g. {example}")
        if stop and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer; this artifact has none")
        if stop and not all(isinstance(s, str) and s for s in stop):
            raise GenerationError("a stop string must be a non-empty string")
        for text in stop or []:
            check_text(text, "a stop string")
        require(prompt_logprobs, "prompt logprobs", "an integer", optional=True)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationError(f"prompt logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        return max_new_tokens

    def from_settings(self, prompt, params: dict) -> Request:
        """make from generate()'s keyword arguments (PARAMS; early_flush is the engine's to check)."""
        unknown = set(params) - SETTINGS
        if unknown:
            raise GenerationError(f"unknown generation setting {sorted(unknown)[0]!r}")
        sampling = sampling_params(params.get("temperature", 0.0), params.get("top_k", 0), params.get("top_p", 1.0),
                                   params.get("repetition_penalty", 1.0), params.get("seed"),
                                   params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0),
                                   params.get("logit_bias"), params.get("logprobs"))
        return self.make(prompt, params.get("max_new_tokens", 64), sampling, params.get("stop"),
                         params.get("stop_at_eos", True), params.get("stop_token_ids"), params.get("prompt_logprobs"),
                         params.get("grammar"), {name: params[name] for name in DEPTH_SETTINGS if name in params})

    def grammar_tokenizer(self, ends: frozenset[int]):
        """llguidance's tokenizer for this artifact whose end-of-sequence ids are ENDS (built once each)."""
        from speedc.runtimes.constraint import GrammarTokenizer

        if self.tokenizer is None:
            raise GenerationError("a grammar needs a tokenizer; this artifact has none")
        if not ends:
            raise GenerationError("a grammar needs an end: stop at the end-of-text id (stop_at_eos) or stop_token_ids")
        with self._lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer(self.tokenizer_file.read_text(), self.dims.vocab_size)
        return self._grammar_tokenizer.for_ends(frozenset(ends))

    def grammar_constraint(self, grammar, ends):
        """GRAMMAR (an llguidance grammar string) compiled and tried for an output ending at ENDS; or GRAMMAR's
        copy when it is a GrammarConstraint already compiled for the same ends (a server compiles off its engine
        thread, once for all of a request's choices). GenerationError when it cannot constrain this output."""
        from speedc.runtimes.constraint import GrammarConstraint

        if isinstance(grammar, GrammarConstraint):
            if grammar.ends != frozenset(ends):
                raise GenerationError("internal: a grammar compiled for other end ids")
            return grammar.copy()
        if not isinstance(grammar, str):
            raise GenerationError(f"grammar must be an llguidance grammar string, not {type(grammar).__name__}")
        return GrammarConstraint(self.grammar_tokenizer(frozenset(ends)), grammar, self.dims.vocab_size, frozenset(ends))

    def end_ids(self, stop_at_eos: bool, stop_token_ids=None) -> frozenset[int]:
        """The ids that end a request: the end-of-text ids (STOP_AT_EOS) and STOP_TOKEN_IDS (checked)."""
        return (self.dims.eos_token_ids if stop_at_eos else frozenset()) | self._stop_ids(stop_token_ids)

    def _stop_ids(self, ids) -> frozenset[int]:
        if ids is None:
            return frozenset()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise GenerationError(f"stop_token_ids must be a list of token ids, not {type(ids).__name__}")
        ids = list(ids)
        vocab = self.dims.vocab_size
        bad = next((i for i in ids if not is_integer(i) or not 0 <= i < vocab), None)
        if bad is not None:
            raise GenerationError(f"stop token id {bad!r:.20} is not a token id (0..{vocab - 1})")
        return frozenset(int(i) for i in ids)
