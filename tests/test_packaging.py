"""The dependency floors in pyproject.toml are the versions `make test-min` runs the suite on."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _floors() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", dep.split(";")[0].strip())
        assert m, f"pyproject.toml: runtime dependency {dep!r} has no plain lower bound"
        out[m.group(1).lower()] = m.group(2)
    return out


def _pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".ci" / "min-versions.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[name.strip().lower()] = version.strip()
    return out


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_pyproject_floors_are_the_tested_minimum_versions():
    floors, pins = _floors(), _pins()
    assert set(floors) == set(pins), f"floors {sorted(floors)} vs pinned {sorted(pins)}"
    for name, floor in floors.items():
        assert _release(floor) == _release(pins[name]), f"{name}: pyproject says >={floor}, test-min runs {pins[name]}"


def test_make_test_min_installs_the_pins():
    makefile = (ROOT / "Makefile").read_text()
    assert "test-min:" in makefile and "-c .ci/min-versions.txt" in makefile
