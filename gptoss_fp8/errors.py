"""The one exception type for user-facing errors.

Its message is shown by the CLI on one line: what went wrong, which file or tensor, what to do.
Internal invariants use ``assert`` instead.
"""


class GptOssFp8Error(Exception):
    """A problem the user can fix (bad input, missing file, full disk...)."""
