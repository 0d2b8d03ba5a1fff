"""The demo's methods and report (``python -m entmtp_hf.demo``): which methods it times, and that each
output is checked against plain decoding on its own path."""

from __future__ import annotations

import torch

from entmtp_hf.demo import run


def test_the_compiled_methods_run_on_a_static_cache_and_can_be_left_out():
    configs = {"gsm8k": "its config"}
    with_compiled = run._methods(configs, None, compiled=True)
    assert list(with_compiled) == [run.PLAIN, run.ENTMTP, run.PLAIN_C, run.ENTMTP_C]
    for name in (run.PLAIN_C, run.ENTMTP_C):
        kwargs = with_compiled[name][1]["gsm8k"]
        assert kwargs["cache_implementation"] == "static" and kwargs["compile_config"]._compile_all_devices
    assert with_compiled[run.ENTMTP_C][1]["gsm8k"]["entmtp_config"] == "its config"


def test_each_output_is_checked_against_plain_decoding_on_its_own_path(capsys):
    """Compiled plain decoding may part from eager plain decoding at a near tie: a compiled method is
    held to compiled plain decoding's output, an eager one to eager plain decoding's."""
    eager, compiled = [1, 2, 3, 4], [1, 2, 9, 9]
    cell = lambda out: {"tps": [10.0], "tau": [1.0], "out": out}  # noqa: E731
    runs = {
        "gsm8k": {
            run.PLAIN: cell(eager),
            run.ENTMTP: cell(eager),
            run.PLAIN_C: cell(compiled),
            run.ENTMTP_C: cell(compiled),
        }
    }
    inputs = [("gsm8k", torch.tensor([[5, 6]]), "a prompt")]
    report = run._report(None, inputs, runs, list(runs["gsm8k"]))
    assert report["identical_to_plain"] and report["mismatches"] == []
    runs["gsm8k"][run.ENTMTP_C] = cell(eager)
    report = run._report(None, inputs, runs, list(runs["gsm8k"]))
    assert [(m["method"], m["position"]) for m in report["mismatches"]] == [(run.ENTMTP_C, 2)]
    assert "NOT identical" in capsys.readouterr().out
