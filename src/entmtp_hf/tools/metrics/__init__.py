"""The ``evaluate`` metrics the tools compute, shipped with the package as metric scripts.

``evaluate.load`` accepts a folder holding a metric script, so a shipped metric loads from an
installed wheel with no Hub access and no checkout; its folder is package data, not a module.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .. import require

PERPLEXITY_DIR = Path(__file__).resolve().parent / "perplexity"


@functools.lru_cache(maxsize=1)
def load_perplexity():
    """The perplexity metric (``evaluate.load`` of the shipped ``perplexity`` folder), loaded once.

    Beyond the Hub's metric it scores a loaded ``model=`` object, tokenizers without a pad
    token and responses given their prompt (``contexts=``); see the script's docstring.
    """
    evaluate = require("evaluate")
    return evaluate.load(str(PERPLEXITY_DIR))
