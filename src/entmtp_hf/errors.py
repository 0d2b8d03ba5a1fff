"""The errors entmtp-hf raises for bad input.

Every refusal of a file, a config field or a ``generate`` argument is an :class:`EntMTPError`
(a ``ValueError``, so code that catches ``ValueError`` keeps working). The subclasses say
what was refused; each message names the file or the field and what would be accepted.
"""

from __future__ import annotations

import os


class EntMTPError(ValueError):
    """Base class of entmtp-hf's input errors."""


class ConfigError(EntMTPError):
    """A config field (``EntMTPConfig``, ``EASConfig``, ``RetrievalConfig``, ...) out of its type or range."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class FileFormatError(EntMTPError):
    """A file that cannot be read: missing, too large, malformed or inconsistent. Names the file."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"{os.fspath(path)}: {problem}")
        self.path = os.fspath(path)
        self.problem = problem


class FieldError(EntMTPError):
    """A field of a file's data (a bank's metadata, a cost table) out of its type or range.

    Raised where the data is checked, which does not know the file; the reader that does
    reports it as a :class:`FileFormatError` naming the file and this message.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem
