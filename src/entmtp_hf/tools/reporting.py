"""How the command line reports bad inputs: one line naming the file and exit status 2, for every
``entmtp-hf`` command and the tools run as modules (below both, so neither imports the other)."""

from __future__ import annotations

import os
import sys
from typing import Callable

from ..errors import FileFormatError
from ..hub import hub_repo_id
from . import missing_extra

#: an input that is a local file or folder, or else a Hub repo id
LOCAL_OR_HUB = "a local file or folder, or a Hub repo id"
#: an input that is a local file or folder
LOCAL = "a local file or folder"


def check_input(flag: str, value: str, kind: str) -> None:
    """One input argument (``flag``: as the help names it): it exists and can be read, or
    (``LOCAL_OR_HUB``) it is a Hub repo id."""
    if not isinstance(value, str) or "{" in value:  # a template such as --eas-config 'eas-{task}.json'
        return
    path = os.path.expanduser(value)
    if os.path.exists(path):
        if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            raise FileFormatError(value, f"cannot be read (permission denied), given as {flag}")
        return
    if kind == LOCAL_OR_HUB and hub_repo_id(value) is not None:
        return  # a Hub repo id: the command downloads it, or says why it cannot
    what = "no such file or folder" + (", and not a valid Hub repo id" if kind == LOCAL_OR_HUB else "")
    raise FileFormatError(value, f"{what} (given as {flag})")


def one_line(error: BaseException) -> str:
    """An error's message on one line; an ``OSError`` about a file names it first."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        message = f"{error.filename}: {error.strerror}"
    else:
        message = str(error) or type(error).__name__
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def missing_extra_status(error: ImportError, prog: str = "entmtp-hf") -> int:
    """Exit status 2 with the extra to install when ``error`` is a missing optional dependency."""
    missing = missing_extra(error)
    if missing is None:
        raise error
    print(f"{prog}: {missing}", file=sys.stderr)
    return 2


def report_errors(prog: str, run: Callable[[], int | None]) -> int:
    """``run()``'s exit status; a missing, unreadable or invalid input (``ValueError``: the
    project's errors name the file; ``OSError``: a file the system could not open or read) or a
    missing optional dependency is one line after ``prog`` and exit status 2."""
    try:
        return run() or 0
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except ImportError as e:
        return missing_extra_status(e, prog)
