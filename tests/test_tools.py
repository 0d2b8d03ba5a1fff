"""The tools' optional dependencies: a tool run without one says which extra installs it."""

from __future__ import annotations

import json
import sys

import pytest

from entmtp_hf.tools import MissingExtra, missing_extra, require
from entmtp_hf.tools.cli import main
from entmtp_hf.tools.metrics import load_perplexity

TOOLS_HINT = "pip install 'entmtp-hf[tools]'"


def test_require_imports_or_names_the_extra(monkeypatch):
    assert require("json") is json
    monkeypatch.setitem(sys.modules, "evaluate", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"evaluate is not installed: pip install 'entmtp-hf\[tools\]'"):
        require("evaluate")
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(ImportError, match=r"entmtp-hf\[train\]"):
        require("accelerate", extra="train")
    load_perplexity.cache_clear()
    with pytest.raises(MissingExtra, match="evaluate"):
        load_perplexity()


def test_missing_extra_knows_the_optional_modules_only():
    found = missing_extra(ModuleNotFoundError("No module named 'datasets.load'", name="datasets.load"))
    assert isinstance(found, MissingExtra) and TOOLS_HINT in str(found)
    assert "entmtp-hf[train]" in str(missing_extra(ModuleNotFoundError(name="accelerate")))
    assert missing_extra(ModuleNotFoundError(name="torch")) is None  # a dependency of the runtime: a real error
    given = MissingExtra("x")
    assert missing_extra(given) is given


def _empty_results(path) -> str:
    settings = {
        "tasks": ["t"],
        "num_prompts": 1,
        "max_new_tokens": 4,
        "preset": "test",
        "mode": "greedy",
        "methods": ["vanilla"],
        "seed": 123,
        "warmup_tokens": 4,
    }
    doc = {
        "format": "entmtp-bench",
        "format_version": 1,
        "settings": settings,
        "environment": {},
        "context": {},
        "skipped": {},
        "prompts": {"t": []},
        "records": [],
    }
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_cli_prints_the_extra_and_exits_2(monkeypatch, tmp_path, capsys):
    results = _empty_results(tmp_path / "results.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # bench-report plots with it
    assert main(["bench-report", results]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entmtp-hf bench-report: matplotlib is not installed") and TOOLS_HINT in err
    assert "Traceback" not in err


def test_the_cli_reraises_other_import_errors(monkeypatch, tmp_path):
    import entmtp_hf.tools.bench.report as report

    def broken(*args, **kwargs):
        raise ImportError("a bug, not a missing extra", name="entmtp_hf.nowhere")

    monkeypatch.setattr(report, "write_report", broken)
    with pytest.raises(ImportError, match="a bug"):
        main(["bench-report", _empty_results(tmp_path / "results.json")])
