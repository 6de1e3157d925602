"""One Engine shared by many threads (what a threaded web app does): calls are serialized on the
engine's one cache, so each output equals what the same call gives alone."""

from __future__ import annotations

import threading

from speedc.runtimes.engine import Engine

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo", "KING HENRY:\n", "First Citizen:\n", "To be, or not"]


def test_eight_threads_share_one_engine(tiny_artifact):
    engine = Engine.load(tiny_artifact)
    calls = [(prompt, mode, seed) for prompt in PROMPTS for mode, seed in (("speed", None), ("autoregressive", None),
                                                                           ("speed", 3))]
    expected = {}
    for prompt, mode, seed in calls:  # alone, one after another
        result = engine.generate(prompt, max_new_tokens=24, mode=mode, seed=seed, temperature=0.9 if seed else 0.0,
                                 stop_at_eos=False)
        expected[prompt, mode, seed] = result.ids
    got: dict = {}
    errors: list = []
    barrier = threading.Barrier(8)

    def worker(index: int) -> None:
        try:
            barrier.wait()  # all threads start together: their calls overlap
            for prompt, mode, seed in calls[index::8] + calls[(index + 3) % 8::8]:
                if index % 2:  # half the threads stream, half generate
                    stream = engine.stream(prompt, max_new_tokens=24, mode=mode, seed=seed,
                                           temperature=0.9 if seed else 0.0, stop_at_eos=False)
                    "".join(stream)
                    ids = stream.ids
                else:
                    ids = engine.generate(prompt, max_new_tokens=24, mode=mode, seed=seed,
                                          temperature=0.9 if seed else 0.0, stop_at_eos=False).ids
                got.setdefault((prompt, mode, seed), []).append(ids)
        except Exception as failure:  # collected: an exception in a thread would otherwise vanish
            errors.append(failure)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert sum(len(v) for v in got.values()) >= len(calls)
    for key, outputs in got.items():
        assert all(ids == expected[key] for ids in outputs), key


def test_abandoned_stream_frees_the_engine(tiny_artifact):
    engine = Engine.load(tiny_artifact)
    stream = engine.stream("ROMEO:\n", max_new_tokens=30, stop_at_eos=False)
    next(stream)  # holds the engine now
    stream.close()
    done = threading.Event()
    threading.Thread(target=lambda: (engine.generate("JULIET:\n", max_new_tokens=4), done.set())).start()
    assert done.wait(timeout=60)
    # Before: leaving a loop over an unnamed stream (break) kept the engine's lock for ever (the stream's
    # generator referred back to the stream: a cycle nothing collected), and the next call hung.
    for _ in engine.stream("ROMEO:\n", max_new_tokens=30, stop_at_eos=False):
        break
    done.clear()
    threading.Thread(target=lambda: (engine.generate("JULIET:\n", max_new_tokens=4), done.set()), daemon=True).start()
    assert done.wait(timeout=60)
    with engine.stream("ROMEO:\n", max_new_tokens=30, stop_at_eos=False) as stream:
        next(stream)
    assert engine.generate("JULIET:\n", max_new_tokens=4).ids  # the with block closed it
