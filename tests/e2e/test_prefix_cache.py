"""The prefix cache: a prompt that begins with an earlier prompt's tokens takes their K/V rows instead of
prefilling them, and its output is bitwise what it is without the cache (ids and log-probabilities), in
SPEED and plain decoding, alone and in a batch; least-recently-used eviction within the budget; served
chats report the tokens it saved."""

from __future__ import annotations

import random
import signal

import numpy as np
import pytest

from conftest import ZOO, build_artifact, random_config, randomize
from serve_server import start_server
from speedc import Engine
from speedc.errors import GenerationError
from speedc.models.llama import SharedLlama
from speedc.runtimes.prefix_cache import PrefixCache

MODES = ("speed-always", "autoregressive")  # speed-always: every step speculates


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """zoo:tiny, and a random P=4 model (its own vocabulary and shapes), fused graphs both."""
    root = tmp_path_factory.mktemp("prefix")
    model = randomize(SharedLlama(random_config(blocks=2, layers=8, heads=4, kv_heads=2, hidden=64, context=400)), seed=8)
    return [Engine.load(build_artifact(ZOO / "tiny", root / "tiny"), threads=1),
            Engine.load(build_artifact(model, root / "random"), threads=1)]


def _cold(engine, prompt, **settings):
    cache, engine.prefix_cache = engine.prefix_cache, None
    try:
        return engine.generate(prompt, **settings)
    finally:
        engine.prefix_cache = cache


def _same(a, b) -> bool:
    return a.ids == b.ids and [p.logprob for p in a.logprobs] == [p.logprob for p in b.logprobs]


def test_a_conversations_next_turn_reuses_its_prompt_and_changes_nothing(engines):
    """Random conversations over both models and modes, prompt lengths around the prefill's row tiles (64k+1)."""
    rng = random.Random(4)
    for engine in engines:
        engine.set_prefix_cache(32)
        vocab = engine.manifest.model["vocab_size"]
        for length in (2, 3, 63, 64, 65, 66, 127, 129, 130, 200):
            first = [rng.randrange(1, vocab) for _ in range(length)]
            reply = engine.generate(first, max_new_tokens=rng.randrange(1, 12), stop_at_eos=False,
                                    mode=rng.choice(MODES))
            turn = first + reply.ids + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 70))]
            settings = dict(max_new_tokens=12, stop_at_eos=False, mode=rng.choice(MODES), logprobs=0,
                            **rng.choice([{}, dict(temperature=0.9, seed=length)]))
            hit = engine.generate(turn, **settings)
            assert hit.stats.cached_tokens == min(length, len(turn) - 2) and hit.stats.prompt_tokens == len(turn)
            assert _same(hit, _cold(engine, turn, **settings)), (length, settings)
            branch = first[:rng.randrange(2, length + 1)] + [1, 2, 3][:rng.randrange(1, 4)]  # a shared prefix, then not
            hit = engine.generate(branch, **settings)
            assert hit.stats.cached_tokens > 0 and _same(hit, _cold(engine, branch, **settings)), (length, branch)
        engine.set_prefix_cache(None)


def test_batched_requests_share_a_system_prompt(engines):
    engine = engines[0]
    system = engine.encode("You are a loyal servant of the king. Speak plainly and briefly, in verse if you must.\n")
    questions = [engine.encode(q) for q in ("Who goes there?", "What news from France?", "Is the queen well?",
                                            "Where is the duke?", "Shall we ride at dawn?")]
    scheduler = engine.batch_scheduler(max_batch=3, prefix_cache_mb=16, prefill_chunk=16)
    expected = [_cold(engine, system + q, max_new_tokens=10, stop_at_eos=False, temperature=0.8, seed=i, logprobs=0)
                for i, q in enumerate(questions)]
    first = scheduler.submit(engine.request_from(system + questions[0], dict(max_new_tokens=10, stop_at_eos=False,
                                                                            temperature=0.8, seed=0, logprobs=0)))
    scheduler.run()
    sequences, requests = [], []
    for i, question in enumerate(questions[1:], 1):
        request = engine.request_from(system + question, dict(max_new_tokens=10, stop_at_eos=False, temperature=0.8,
                                                              seed=i, logprobs=0))
        requests.append(request)
        sequences.append(scheduler.submit(request))
    scheduler.run()
    assert first.out == expected[0].ids
    for sequence, request, want in zip(sequences, requests, expected[1:]):
        assert sequence.out == want.ids and [p.logprob for p in request.picker.logprobs] == \
            [p.logprob for p in want.logprobs]
        assert sequence.stats.cached_tokens >= len(system)  # the system prompt at least (a question may share more)


def test_eviction_keeps_the_most_recently_used_within_the_budget():
    rows = lambda n: [np.zeros((1, 1, 1, n, 4), np.float32)]  # 16 bytes a position
    cache = PrefixCache(budget_bytes=16 * 25)
    cache.store([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], rows(10))
    cache.store([7, 7, 7, 7, 7, 7, 7, 7, 7, 7], rows(10))
    assert cache.lookup([1, 2, 3, 4, 9, 9])[1] == 4  # marks the first used: the second is now the oldest
    cache.store([5, 5, 5, 5, 5, 5, 5, 5, 5, 5], rows(10))
    assert len(cache) == 2 and cache.evictions == 1 and cache.nbytes == 16 * 20
    assert cache.lookup([7, 7, 7, 7])[0] is None  # evicted
    assert cache.lookup([1, 2, 3])[1] == 2 and cache.lookup([1, 2, 3], keep=2)[1] == 1
    cache.store([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], rows(12))  # holds the first one's tokens: it replaces it
    assert len(cache) == 2 and cache.nbytes == 16 * 22 and cache.lookup(list(range(1, 14)))[1] == 12
    cache.store(list(range(100, 130)), rows(30))  # larger than the budget: not kept
    assert len(cache) == 2


def test_standard_graphs_and_bad_sizes_have_no_prefix_cache(engines, tmp_path):
    numpy_fed = Engine.load(engines[0].directory, backend="onnx-numpy", threads=1, prefix_cache_mb=8)
    numpy_fed.generate([5, 6, 7, 8], max_new_tokens=2)
    again = numpy_fed.generate([5, 6, 7, 8, 9, 10], max_new_tokens=2)
    assert again.stats.cached_tokens == 0  # its chunked prefill depends on where chunks begin: no reuse there
    with pytest.raises(GenerationError, match="finite number >= 0"):
        engines[0].set_prefix_cache(-1)


def test_served_chat_reports_cached_tokens(engines, tmp_path):
    import openai

    template = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    (tmp_path / "chat.jinja").write_text(template)
    engine = engines[0]
    running = start_server(engine.directory, tmp_path, "--model-name", "tiny", "--chat-template", str(tmp_path / "chat.jinja"))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "You are the king's herald. " * 8},
                    {"role": "user", "content": "Who goes there?"}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And what news?"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        rendered = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        ids = engine.tokenizer.encode(rendered, add_special_tokens=False).ids
        assert second.usage.prompt_tokens == len(ids)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
        assert second.choices[0].message.content == _cold(engine, ids, max_new_tokens=12).text
        assert running.metrics()["speedc_prompt_tokens_cached_total"] == second.usage.prompt_tokens_details.cached_tokens
        assert running.metrics()["speedc_prefix_cache_bytes"] > 0
    finally:
        assert running.stop() == -signal.SIGTERM, running.log.read_text()
