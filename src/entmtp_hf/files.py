"""Bounded readers for the files entmtp-hf loads (bank metadata, head configs, shard indexes).

Python's ``json`` module recurses once per nesting level and turns every digit string into an
int, so an untrusted file can raise ``RecursionError`` or spend seconds on one number before
any schema check runs. These readers bound the input first (bytes, then nesting depth with a
linear scan that skips string contents, then digits per number) and report every problem as a
:class:`~entmtp_hf.errors.FileFormatError` that names the file and the limit.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
from typing import Any

from .errors import FileFormatError

#: Digits allowed in one JSON number: far above any size or count a config holds, far below
#: where converting the digits to an int costs noticeable time.
MAX_NUMBER_DIGITS = 100

# A JSON string literal (escapes included, the closing quote optional so that an unterminated
# string swallows the rest, as the parser would), written without nested repetition so the
# match is linear in the string's length.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def nesting_depth(text: str | bytes, limit: int) -> int:
    """Deepest ``[``/``{`` nesting of a JSON text, counting at most to ``limit + 1``.

    Linear in the text: string literals are blanked with one regex pass, everything but
    brackets is deleted, and the scan stops as soon as the depth passes ``limit``.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for char in brackets:
        if char in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


class _OverLimit(ValueError):
    """A number the parse hooks refuse; its message completes "<what> ..."."""


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise _OverLimit(f"has a number of {len(digits)} digits, above the limit of {MAX_NUMBER_DIGITS}")
    return int(digits)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_DIGITS + 10:  # room for sign, point and exponent
        raise _OverLimit(f"has a number of {len(text)} characters, above the limit of {MAX_NUMBER_DIGITS} digits")
    value = float(text)
    if not math.isfinite(value):
        raise _OverLimit(f"has the number {text}, which overflows a float")
    return value


def _refuse_constant(name: str) -> Any:
    raise _OverLimit(f"has {name}, which is not valid JSON (only finite numbers are)")


def parse_json(
    text: str | bytes, source: str | os.PathLike[str], *, max_bytes: int, max_depth: int, what: str = "the JSON text"
) -> Any:
    """Parse untrusted JSON text; every problem is a :class:`FileFormatError` naming ``source``.

    ``what`` says which part of the file the text is (e.g. a safetensors header entry).
    """
    size = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else len(text)
    if size > max_bytes:
        raise FileFormatError(source, f"{what} is {size} bytes, above the limit of {max_bytes}")
    if nesting_depth(text, max_depth) > max_depth:
        raise FileFormatError(source, f"{what} nests deeper than the limit of {max_depth} levels")
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant)
    except _OverLimit as e:
        raise FileFormatError(source, f"{what} {e}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise FileFormatError(source, f"{what} is not valid JSON ({e})") from None


def read_json(path: str | os.PathLike[str], *, max_bytes: int, max_depth: int) -> Any:
    """Read and parse a JSON file of at most ``max_bytes`` bytes and ``max_depth`` nesting levels."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # never reads more than the limit, whatever the file claims
    except OSError as e:
        raise FileFormatError(path, f"cannot read the file ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise FileFormatError(path, f"file is larger than the limit of {max_bytes} bytes")
    return parse_json(data, path, max_bytes=max_bytes, max_depth=max_depth, what="the file")


def read_json_object(path: str | os.PathLike[str], *, max_bytes: int, max_depth: int) -> dict[str, Any]:
    """:func:`read_json` for files whose top level must be an object (configs, indexes)."""
    data = read_json(path, max_bytes=max_bytes, max_depth=max_depth)
    if not isinstance(data, dict):
        raise FileFormatError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def check_relative_name(name: object, source: str | os.PathLike[str]) -> str:
    """A file name read from data (e.g. a shard index) that must stay inside its repository.

    Refuses non-strings, absolute paths, drive letters, backslashes and any ``..`` part: a
    Hub repo has no parent to escape to, so a name that tries is malformed, never useful.
    """
    if not isinstance(name, str) or not name:
        raise FileFormatError(source, f"file name {name!r} is not a non-empty string")
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or ":" in parts[0] or ".." in parts or "\x00" in name:
        raise FileFormatError(source, f"file name {name!r} leaves the folder; only relative names inside it are read")
    return name


def resolve_inside(folder: str | os.PathLike[str], name: object, source: str | os.PathLike[str]) -> str:
    """``folder/name`` as a path string, refusing any ``name`` that leaves ``folder``.

    The check is lexical (normalise, then compare): ``sub/../x`` is fine, ``../x`` and
    absolute names are not. Symbolic links the folder itself holds are followed as usual,
    since the folder's owner placed them there (a Hub cache snapshot links every file to a
    blob outside the snapshot); only names that come from file contents are distrusted.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise FileFormatError(source, f"file name {name!r} is not a non-empty string")
    root = os.path.normpath(os.path.abspath(folder))
    if os.path.isabs(name) or posixpath.isabs(name):
        raise FileFormatError(source, f"file name {name!r} is absolute; only names inside {root} are read")
    path = os.path.normpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root or path == root:
        raise FileFormatError(source, f"file name {name!r} leaves the folder {root}")
    return path
