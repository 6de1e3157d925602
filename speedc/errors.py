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
