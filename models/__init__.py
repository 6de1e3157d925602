"""speedc.models: the shared-weight decoder family, checkpoints, reference decoding, training.

Knows nothing of passes, runtimes or the CLI.
"""
