"""The one base of the errors mtkit reports to its user: bad input, a bad setting, a missing resource.

The command line prints such an error as one ``error:`` line with exit status 1; anything else is a
bug and keeps its traceback. Library users catch ``MtkitError`` for the same distinction.
"""


class MtkitError(Exception):
    """A problem with what mtkit was given (a file, a setting, a machine), said in one line."""


class TrainingFailed(MtkitError, RuntimeError):
    """Training cannot go on (divergence, repeated out-of-memory, a failed write); the last good checkpoint is kept."""
