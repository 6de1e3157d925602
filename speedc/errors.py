"""User-facing errors: each carries a one-line message the CLI prints without a traceback.

This module imports nothing, so every layer (models, passes, runtimes, CLI) can raise these
without pulling in any other part of speedc.
"""


class SpeedcError(Exception):
    """Bad input or an unmet precondition; the message is the whole story for the user."""


class CheckpointError(SpeedcError):
    """A checkpoint directory or file that cannot be read as a speedc / Llama model."""


class BuildError(SpeedcError):
    """The compiler refused or failed to produce an artifact."""


class ArtifactError(SpeedcError):
    """A compiled artifact that is missing, corrupt, or from an incompatible speedc version."""


class GenerationError(SpeedcError):
    """Bad generation request: empty prompt, ids outside the vocabulary, context overflow."""


class BatchError(GenerationError):
    """Some prompts of a batch could not be generated; RESULTS holds the others' results in prompt
    order (None where one failed), so finished work is not lost."""

    def __init__(self, message: str, results: list) -> None:
        super().__init__(message)
        self.results = results


class OutOfMemory(GenerationError):
    """Memory for a request's KV cache could not be allocated (servers answer 503: retry later or
    lower the memory asked for)."""
