"""Where entmtp-hf keeps what it builds once per user: the demo model, measured cost tables."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ENTMTP_HF_CACHE``, else ``$XDG_CACHE_HOME/entmtp-hf``, else ``~/.cache/entmtp-hf``."""
    if os.environ.get("ENTMTP_HF_CACHE"):
        return Path(os.environ["ENTMTP_HF_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "entmtp-hf"
