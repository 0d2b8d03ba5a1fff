"""The ``entmtp-hf`` dispatcher: every command given a missing, unreadable or invalid input prints
one line naming the file and what is wrong, and exits with status 2, before any work."""

from __future__ import annotations

import argparse

import pytest

from entmtp_hf.tools import cli
from entmtp_hf.tools.cli import INPUTS, build_parser, main


def _commands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    parser = parser or build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _running(monkeypatch, command: str, func) -> argparse.ArgumentParser:
    """The CLI with ``command`` running ``func`` instead of its work; returns that command's parser."""
    parser = build_parser()
    _commands(parser)[command].set_defaults(func=func)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    return _commands(parser)[command]


def _argv(command: str, parser: argparse.ArgumentParser, missing_dest: str, missing: str, tmp_path) -> list[str]:
    """A command line with every required argument given, and ``missing_dest`` set to ``missing``."""
    positional, options = [], []
    for action in parser._actions:
        if action.dest == "help" or not (action.required or action.dest == missing_dest or not action.option_strings):
            continue
        if action.dest == missing_dest:
            value = missing
        elif action.dest in INPUTS:
            value = str(tmp_path)  # another input, there
        elif action.choices:
            value = min(action.choices)
        else:
            value = str(tmp_path / f"{action.dest}-out")  # outputs and names: never read before the inputs' check
        if action.option_strings:
            options += [action.option_strings[-1], value]
        else:
            positional.append(value)
    return [command, *positional, *options]


CASES = [(name, action.dest) for name, p in _commands().items() for action in p._actions if action.dest in INPUTS]


def test_every_command_reads_an_input_the_dispatcher_checks():
    assert {name for name, _ in CASES} == set(_commands())


@pytest.mark.parametrize("command, dest", CASES, ids=[f"{c}-{d}" for c, d in CASES])
def test_a_missing_input_is_one_line_and_exit_status_2(command, dest, tmp_path, capsys, monkeypatch):
    parser = _running(monkeypatch, command, _never_runs)
    missing = str(tmp_path / "no-such-folder" / "input.json")
    assert main(_argv(command, parser, dest, missing, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"entmtp-hf {command}: error: {missing}: no such file or folder")


def _never_runs(args: argparse.Namespace) -> int:
    raise AssertionError("the command ran although an input is missing")


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(2, "No such file or directory", "/data/x.bin"),
        PermissionError(13, "Permission denied", "/data/y"),
        IsADirectoryError(21, "Is a directory", "/data/z"),
        OSError("We couldn't connect to the Hub\nto load the files\n"),
    ],
)
def test_a_system_error_inside_a_command_is_one_line(error, capsys, monkeypatch, tmp_path):
    """What the dispatcher does with an OSError any command raises (a file that vanished, a model
    transformers cannot find)."""

    def raises(args: argparse.Namespace) -> int:
        raise error

    _running(monkeypatch, "bench-report", raises)
    results = tmp_path / "results.json"
    results.write_text("{}")
    assert main(["bench-report", str(results)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (error.filename or "connect to the Hub") in err


@pytest.mark.parametrize("command", ["bench-report", "regime", "acceptance"])
@pytest.mark.parametrize("text", ["not json", "[1, 2]", "\xff\xfe"])
def test_an_invalid_results_file_is_named(command, text, tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_bytes(text.encode("latin-1"))
    assert main([command, str(results)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"entmtp-hf {command}: error: {results}: ")


def test_a_folder_given_as_a_results_file_is_one_line(tmp_path, capsys):
    assert main(["bench-report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err


def test_a_hub_repo_id_passes_the_check_and_a_template_is_left_to_the_command():
    cli.check_input("--heads", "org/heads", cli.LOCAL_OR_HUB)  # resolved (or refused) by the command
    cli.check_input("--eas-config", "runs/eas-{task}.json", cli.LOCAL)
    with pytest.raises(ValueError, match="no such file or folder, and not a valid Hub repo id"):
        cli.check_input("--heads", "./heads/missing", cli.LOCAL_OR_HUB)


def test_the_distill_command_checks_its_model_the_same_way(tmp_path, capsys, monkeypatch):
    from entmtp_hf.tools.data import distill

    monkeypatch.setattr(distill, "load_base_model", lambda **k: pytest.fail("the model was loaded"))
    missing = str(tmp_path / "no-such-model")
    assert distill.main(["--out", str(tmp_path / "out"), "--model", missing, "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"entmtp_hf.tools.data.distill: error: {missing}: no such file or folder, and not a valid Hub repo "
        f"id (given as --model)\n"
    )
