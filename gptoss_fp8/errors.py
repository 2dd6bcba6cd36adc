"""The one exception type for user-facing errors.

Its message is shown by the CLI on one line: what went wrong, which file or tensor, what to do.
Internal invariants use ``assert`` instead.
"""


class GptOssFp8Error(Exception):
    """A problem the user can fix (bad input, missing file, full disk...)."""


class OutputFormatError(GptOssFp8Error):
    """A request's output format (its grammar) failed while its reply was drawn: the request's fault (a schema no
    finite reply fits, one past the grammar engine's limits), so the server answers 400, not 500."""
