"""Prompt pools of the self-distillation tool: sources and rounds of self-written chat questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entmtp_hf.tools.data import datasets as D
from entmtp_hf.tools.data import distill

REPO = Path(__file__).resolve().parents[1]


def test_question_rounds_repeat_the_openers_under_new_ids():
    one, three = D.user_openers(), D.user_openers(3)
    assert len(three) == 3 * len(one) and len({p.prompt_id for p in three}) == len(three)
    assert three[: len(one)] == one  # round 1 keeps its ids: questions already written are reused
    assert [p.text for p in three[len(one) : 2 * len(one)]] == [p.text for p in one]
    assert all(p.prompt_id.endswith("-r3") for p in three[2 * len(one) :])
    written = {json.loads(line)["prompt_id"] for line in (REPO / "data/distill/questions.jsonl").open()}
    rounds = max(int(i.rsplit("-r", 1)[1]) if "-r" in i else 1 for i in written)
    assert written <= {p.prompt_id for p in D.user_openers(rounds)}  # the shipped questions' ids still exist
    with pytest.raises(ValueError, match="rounds"):
        D.user_openers(0)


def test_sources_choose_the_pools():
    pools = distill.source_pools(("chat",), entry_points=[])
    assert list(pools) == ["chat"] and pools["chat"] and all(p.source == "chat" for p in pools["chat"])
    with pytest.raises(ValueError, match="unknown or no prompt sources"):
        distill.source_pools(("chat", "poetry"), entry_points=[])


def test_a_run_over_some_sources_keeps_the_earlier_checks_of_the_others(tmp_path):
    earlier = {
        "math": {"size": 7, "hits": {}, "examples": []},
        "chat": {"size": 1, "hits": {}, "examples": []},
        "kept": {"math": 7, "chat": 1},
    }
    (tmp_path / "disjointness.json").write_text(json.dumps(earlier))
    distill.build_pool(tmp_path, lambda m: None, 1, 0, False, sources=("chat",))
    report = json.loads((tmp_path / "disjointness.json").read_text())
    assert report["math"] == earlier["math"] and report["kept"]["math"] == 7  # not checked again, kept
    assert report["chat"]["size"] > 1 and report["kept"]["chat"] == report["chat"]["size"]  # checked again


@pytest.mark.parametrize("argv", [["--sources", "chat,poetry"], ["--sources", ","], ["--question-rounds", "0"]])
def test_bad_options_stop_before_the_model_loads(argv, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "load_base_model", lambda **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):
        distill.main(["--out", str(tmp_path), *argv])
