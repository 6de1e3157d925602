"""The embedding API refuses bad arguments before anything runs, and misuse never hangs or wedges.

Found by an embedding review (each was a hang, a poisoned engine or a bare TypeError deep in a step):
a float max_new_tokens froze the EngineLoop for good (the request failed every step while it headed the
queue) and poisoned the IO-binding backend; top_k=3.0 failed every request of its batch; a call inside
one's own open stream waited for ever; submit from another thread never woke the loop; a loop used under
a second asyncio.run failed; bytes ran as token ids.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import numpy as np
import pytest

from speedc.format.artifact import read_manifest
from speedc.errors import ArtifactError, GenerationError, SpeedcError
from speedc.runtimes.engine import Engine
from speedc.runtimes.engine_loop import EngineLoop

PROMPT = "ROMEO:\n"


@pytest.fixture(scope="module")
def engine(tiny_artifact) -> Engine:
    return Engine.load(tiny_artifact)


BAD_ARGUMENTS = [  # (keyword arguments, a fragment of the one-line error)
    ({"max_new_tokens": 8.0}, "max new tokens must be an integer, not float"),
    ({"max_new_tokens": "8"}, "max new tokens must be an integer, not str"),
    ({"max_new_tokens": None}, "max new tokens must be an integer"),
    ({"top_k": 3.0, "temperature": 1.0}, "top-k must be an integer, not float"),
    ({"seed": 1.5, "temperature": 1.0}, "seed must be an integer"),
    ({"seed": "a"}, "seed must be an integer, not str"),  # checked even when greedy
    ({"temperature": "0.5"}, "temperature must be a number, not str"),
    ({"temperature": None}, "temperature must be a number"),
    ({"top_p": "x"}, "top-p must be a number"),
    ({"repetition_penalty": None}, "repetition penalty must be a number"),
    ({"stop": 5}, "stop must be a list of strings"),
    ({"stop": "\n"}, "stop must be a list of strings, e.g. stop=['\\n']"),
    ({"stop_at_eos": "no"}, "stop_at_eos must be True or False"),
    ({"early_flush": 1}, "early_flush must be True, False or None"),
]


@pytest.mark.parametrize("arguments,fragment", BAD_ARGUMENTS, ids=lambda v: str(v)[:30])
def test_bad_arguments_are_one_named_error_everywhere(engine, tiny_artifact, arguments, fragment):
    """generate, stream and generate_batch refuse at the call, before a token; the engine still works."""
    with pytest.raises(GenerationError) as raised:
        engine.generate(PROMPT, **arguments)
    assert fragment in str(raised.value)
    with pytest.raises(GenerationError) as raised:
        engine.stream(PROMPT, **arguments)
    assert fragment in str(raised.value)
    with pytest.raises(GenerationError) as raised:
        engine.generate_batch([PROMPT], **arguments)
    assert str(raised.value).startswith("prompt 1: ") and fragment in str(raised.value)
    assert engine.generate(PROMPT, max_new_tokens=4).ids == engine.generate(PROMPT, max_new_tokens=4,
                                                                             mode="autoregressive").ids


@pytest.mark.parametrize("prompt,fragment", [
    (b"ROMEO", "not bytes"), (None, "not NoneType"), (5, "not int"),
    ([1.7], "prompt ids must be integers, not float"), (["5"], "prompt ids must be integers, not str"),
    ([True, 2], "prompt ids must be integers, not bool"),
])
def test_prompts_are_text_or_integer_ids(engine, prompt, fragment):
    with pytest.raises(GenerationError) as raised:
        engine.generate(prompt, max_new_tokens=2)
    assert fragment in str(raised.value)


def test_integer_types_of_numpy_are_integers(engine):
    ids = engine.encode(PROMPT)
    expected = engine.generate(ids, max_new_tokens=6, top_k=5, temperature=0.7, seed=3).ids
    got = engine.generate(np.array(ids, np.int64), max_new_tokens=np.int64(6), top_k=np.int32(5),
                          temperature=np.float32(0.7), seed=np.uint8(3)).ids
    assert got == expected


def test_batch_arguments_are_checked(engine):
    with pytest.raises(GenerationError, match="prompts must be a list"):
        engine.generate_batch(PROMPT)  # was one prompt a character
    with pytest.raises(GenerationError, match="settings must be a list of dicts"):
        engine.generate_batch([PROMPT], settings=[5])
    for options, fragment in (({"max_batch": 2.0}, "max_batch must be an integer"),
                              ({"prefill_chunk": 0}, "prefill_chunk must be at least 1"),
                              ({"prefill_chunk": 8.0}, "prefill_chunk must be an integer"),
                              ({"kv_cache_mb": "64"}, "kv_cache_mb must be a number"),
                              ({"row_budget": -1}, "row_budget must be >= 0")):
        with pytest.raises(GenerationError, match=fragment):
            engine.generate_batch([PROMPT], max_new_tokens=2, **options)


def test_threads_must_be_a_count(tiny_artifact, monkeypatch):
    with pytest.raises(SpeedcError, match="threads must be a positive integer"):
        Engine.load(tiny_artifact, threads="2")
    monkeypatch.setenv("SPEEDC_THREADS", "two")
    with pytest.raises(SpeedcError, match="SPEEDC_THREADS='two' is not a number"):
        Engine.load(tiny_artifact)


def test_a_call_inside_ones_own_open_stream_is_an_error_not_a_hang(engine):
    expected = engine.generate("JULIET:", max_new_tokens=4).ids
    stream = engine.stream(PROMPT, max_new_tokens=32, stop_at_eos=False)
    next(stream)  # this thread holds the engine now
    with pytest.raises(GenerationError, match="this thread holds the engine in an open stream"):
        engine.generate("JULIET:", max_new_tokens=4)
    other = engine.stream("JULIET:", max_new_tokens=4)
    with pytest.raises(GenerationError, match="open stream"):  # two interleaved streams, one thread
        next(other)
    stream.close()
    assert engine.generate("JULIET:", max_new_tokens=4).ids == expected


def test_another_thread_waits_for_a_stream_and_can_close_it(engine):
    """close() from another thread (a client went away) ends the stream at its next token; before, it
    raised 'generator already executing' and the stream ran on to its end."""
    expected = engine.generate("JULIET:", max_new_tokens=4).ids
    stream = engine.stream(PROMPT, max_new_tokens=400, stop_at_eos=False)
    first = threading.Event()
    pieces: list[str] = []

    def read() -> None:
        for piece in stream:
            pieces.append(piece)
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(timeout=60)
    stream.close()  # from this thread, while the reader iterates
    reader.join(timeout=60)
    assert not reader.is_alive() and 0 < len(stream.ids) < 400
    assert "".join(pieces) == engine.decode_text(stream.ids)[:len("".join(pieces))]
    assert engine.generate("JULIET:", max_new_tokens=4).ids == expected  # the engine was released


def _alone(engine: Engine, prompt: str, tokens: int) -> list[int]:
    return engine.generate(prompt, max_new_tokens=tokens, mode="autoregressive").ids


def test_engine_loop_refuses_bad_requests_and_the_others_run(engine):
    async def main():
        loop = EngineLoop(engine, max_batch=4)
        good = [loop.submit(p, max_new_tokens=10) for p in ("ROMEO:", "JULIET:")]
        for arguments, fragment in (({"max_new_tokens": 100.0}, "max new tokens must be an integer"),
                                    ({"top_k": 3.0, "temperature": 1.0, "seed": 1}, "top-k must be an integer")):
            with pytest.raises(GenerationError, match=fragment):
                loop.submit("KING:", **arguments)
        results = [await asyncio.wait_for(r.wait(), 120) for r in good]
        await loop.aclose()
        return results

    results = asyncio.run(main())
    assert [r.ids for r in results] == [_alone(engine, p, 10) for p in ("ROMEO:", "JULIET:")]


def test_engine_loop_submit_from_another_thread_and_a_second_asyncio_run(engine):
    """submit from a thread that is not the loop's wakes the loop (it never started before); the same
    EngineLoop used again under a later asyncio.run moves to that event loop (an Event bound to the
    first loop failed before); submit without any event loop queues nothing."""
    loop = EngineLoop(engine, max_batch=2)
    with pytest.raises(RuntimeError, match="needs a running event loop"):
        loop.submit("ROMEO:", max_new_tokens=4)
    assert loop.waiting == 0  # nothing left behind

    event_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=event_loop.run_forever, daemon=True)
    thread.start()
    try:
        async def first():
            return await loop.submit("A", max_new_tokens=2).wait()

        asyncio.run_coroutine_threadsafe(first(), event_loop).result(120)
        request = loop.submit("ROMEO:", max_new_tokens=10)  # this thread: the loop task is idle, waiting
        result = asyncio.run_coroutine_threadsafe(request.wait(), event_loop).result(120)
        assert result.ids == _alone(engine, "ROMEO:", 10)
    finally:
        event_loop.call_soon_threadsafe(event_loop.stop)
        thread.join(timeout=30)
        event_loop.close()

    async def again(prompt):
        return (await asyncio.wait_for(loop.submit(prompt, max_new_tokens=10).wait(), 120)).ids

    assert asyncio.run(again("JULIET:")) == _alone(engine, "JULIET:", 10)
    assert asyncio.run(again("KING:")) == _alone(engine, "KING:", 10)


def test_a_request_that_fails_admission_ends_alone(engine, monkeypatch):
    """A scripted stand-in: admitting the request of 100 new tokens raises an error that is not
    OutOfMemory (a bug, say). That request ends alone with it; before, it stayed at the head of the queue
    and failed every step for ever (100% CPU), and the requests behind it never ran."""
    from speedc.runtimes.batch import BatchScheduler

    real_grow = BatchScheduler._grow_pool

    def grow(self, sequences):
        if any(s.request.max_new_tokens == 100 for s in sequences):
            raise AttributeError("a stand-in failure admitting it")
        return real_grow(self, sequences)

    monkeypatch.setattr(BatchScheduler, "_grow_pool", grow)

    async def main():
        loop = EngineLoop(engine, max_batch=2)
        long = loop.submit("ROMEO:", max_new_tokens=100)
        short = [loop.submit(p, max_new_tokens=8) for p in ("JULIET:", "KING:")]
        with pytest.raises(AttributeError, match="stand-in"):
            await asyncio.wait_for(long.wait(), 120)
        results = [await asyncio.wait_for(r.wait(), 120) for r in short]
        await loop.aclose()
        return long, results

    long, results = asyncio.run(main())
    assert long.result is None and long.sequence.stats.stop_reason == "error"
    assert [r.ids for r in results] == [_alone(engine, p, 8) for p in ("JULIET:", "KING:")]


def test_a_failed_cache_allocation_does_not_poison_the_next_request(tiny_artifact, monkeypatch):
    """A pool that cannot grow for a request (out of memory, twice: the retry after freeing the pool
    too) fails that request in one line; the engine's next requests run as before, that length too."""
    from speedc.errors import OutOfMemory
    from speedc.runtimes.backends import onnx as batch_backend

    engine = Engine.load(tiny_artifact)
    long = 300  # past the pool of the short request before: the pool must grow
    expected = engine.generate(PROMPT, max_new_tokens=long, stop_at_eos=False).ids
    engine = Engine.load(tiny_artifact)
    engine.generate(PROMPT, max_new_tokens=3)  # a pool of another length in place
    real = batch_backend.np.zeros
    failures = {"left": 2}

    def failing_twice(shape, *args, **kwargs):
        if isinstance(shape, tuple) and len(shape) == 6 and failures["left"]:  # [S, P, W, kvh, T + 1, hd]
            failures["left"] -= 1
            raise MemoryError
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(batch_backend.np, "zeros", failing_twice)
    with pytest.raises(OutOfMemory, match=r"cannot grow to 320 positions"):  # prompt + 300 within 5 x 64
        engine.generate(PROMPT, max_new_tokens=long, stop_at_eos=False)
    assert engine.generate(PROMPT, max_new_tokens=long, stop_at_eos=False).ids == expected


def test_a_manifest_without_the_models_context_is_one_line(tiny_artifact, tmp_path):
    damaged = tmp_path / "art"
    shutil.copytree(tiny_artifact, damaged)
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest["model"]["max_context"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"model.max_context missing or not a positive integer"):
        read_manifest(damaged)
