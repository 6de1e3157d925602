"""`speedc bench`'s measurements (the CLI commands themselves are speedc/cli/bench.py).

    run        SPEED against plain decoding (and peers), interleaved, ids checked first: run_bench,
               BenchReport; c(P) is measured by speedc.step_timer (the build path), the bound is
               speedc.cost_model.analytic_bound
    peers      peer systems: PyTorch reference, transformers, ORT GenAI fp32 (the artifact's weights: ids
               must match) and ORT GenAI int4 (other precision: agreement reported); PEERS registry
    memory     peak RSS of each system, each in a fresh process (`python -m speedc.bench.memory`)
    sweep      artifact --sweep slots|length
    concurrency  `speedc bench concurrency`: continuous batching at several client counts
    synthetic  `speedc bench memory-bound`: c(P) on a large random-weight model (also the GPU check's model)
    plot       --plot FILE.png

Nothing is imported here: `import speedc.bench` stays free of numpy, onnxruntime and torch.
"""
