"""What a user gave moeloop was wrong (a config field, a row of a data or prompts file, a command-line flag), as
opposed to a bug. The message names the field, or the file and line; the `moeloop` command prints it without a
traceback and exits 2."""
from __future__ import annotations

from typing import Any


class InputError(ValueError):
    """Bad user input; the message says where (a ValueError, so callers that caught those still do)."""


def chat_messages(prompt: Any, where: str) -> list[dict]:
    """A prompt field as chat messages: a string is one user message; a list must hold {"role": str, "content": str}
    objects. Anything else is an InputError naming `where` (file:line) and the problem."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise InputError(f"{where}: a prompt must be a string or a non-empty list of chat messages, "
                         f"got {type(prompt).__name__}")
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InputError(f"{where}: message {i} must be an object with string 'role' and 'content', got {m!r:.80}")
    return prompt
