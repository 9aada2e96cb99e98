"""What a user gave moeloop was wrong (a config field, a row of a data or prompts file, a command-line flag), as
opposed to a bug. The message names the field, or the file and line; the `moeloop` command prints it without a
traceback and exits 2."""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input; the message says where (a ValueError, so callers that caught those still do)."""

