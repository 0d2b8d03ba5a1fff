"""The shared checks of :mod:`entmtp_hf.validation`: what each accepts, what it refuses and how
the refusal names the field, with the caller's error type."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from entmtp_hf.errors import ConfigError, EntMTPError, FieldError
from entmtp_hf.validation import (
    brief_list,
    brief_repr,
    choice,
    flag,
    increasing,
    integer,
    mapping,
    number,
    numbers_in,
    sequence,
    taus,
    thresholds,
)


def test_number_accepts_finite_reals_as_floats():
    assert number(1, "x") == 1.0 and isinstance(number(1, "x"), float)
    assert number(np.float32(0.5), "x") == 0.5 and number(Fraction(1, 4), "x") == 0.25
    assert number(0.0, "x", low=0.0) == 0.0 and number(1.0, "x", high=1.0) == 1.0


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        "1",
        None,
        [1.0],
        math.nan,
        math.inf,
        -math.inf,
        10**400,
        torch.tensor(1.0),
        torch.tensor([1.0, 2.0]),
        np.array([1.0]),
    ],
)
def test_number_refuses_what_is_not_a_finite_real(value):
    with pytest.raises(ConfigError, match=r"^x: must be a finite number, got") as err:
        number(value, "x")
    assert err.value.field == "x"


@pytest.mark.parametrize(
    "kwargs, value, message",
    [
        (dict(low=0.0, low_open=True), 0.0, r"0\.0 is outside \(0, inf\)"),
        (dict(low=0.0, high=1.0), 1.5, r"1\.5 is outside \[0, 1\]"),
        (dict(high=1.0, high_open=True), 1.0, r"1\.0 is outside \(-inf, 1\)"),
    ],
)
def test_number_ranges(kwargs, value, message):
    with pytest.raises(ConfigError, match=message):
        number(value, "x", **kwargs)


def test_the_span_is_said_when_the_type_is_wrong():
    with pytest.raises(ConfigError, match="must be a finite number > 0, got 'a'"):
        number("a", "x", low=0.0, low_open=True)
    with pytest.raises(ConfigError, match=r"must be a finite number in \[0, 1\]"):
        number(None, "x", low=0.0, high=1.0)


def test_integer_needs_a_range_and_refuses_bools_floats_and_huge_values():
    assert integer(np.int64(3), "n", low=0, high=4) == 3 and type(integer(np.int64(3), "n", low=0, high=4)) is int
    assert integer(torch.tensor(2), "n", low=0, high=4) == 2
    for bad in (True, 2.0, "2", None, 2**63, -1, torch.tensor([1, 2]), [2]):
        with pytest.raises(ConfigError, match=r"^n: must be an integer in \[0, 4\], got"):
            integer(bad, "n", low=0, high=4)
    with pytest.raises(TypeError):
        integer(1, "n", low=0)  # type: ignore[call-arg]  # every integer field has a maximum


def test_the_callers_error_type_is_raised():
    with pytest.raises(FieldError, match=r"^tau_on must be a finite number, got 'x'$") as err:
        number("x", "tau_on", error=FieldError)
    assert isinstance(err.value, EntMTPError) and isinstance(err.value, ValueError) and err.value.field == "tau_on"


def test_flag_and_choice():
    assert flag(False, "f") is False
    for bad in (0, 1, "no", None):
        with pytest.raises(ConfigError, match="must be True or False"):
            flag(bad, "f")
    assert choice("a", "c", ("a", "b")) == "a"
    for bad in ("z", [1], {"a": 1}, 1, None):  # unhashable values are refused like the others
        with pytest.raises(ConfigError, match=r"must be one of \['a', 'b'\]"):
            choice(bad, "c", ("a", "b"))


def test_sequences_and_numbers_in():
    assert sequence([1, 2], "s", of="things") == (1, 2) and sequence(range(2), "s", of="things") == (0, 1)
    for bad in ("ab", b"ab", {"a": 1}, 3, None, torch.tensor([1, 2])):
        with pytest.raises(ConfigError, match="must be a list of things"):
            sequence(bad, "s", of="things")
    with pytest.raises(ConfigError, match="at most 2 things, got 3"):
        sequence([1, 2, 3], "s", of="things", max_len=2)
    assert numbers_in([1, 2.5], "v", low=0.0) == (1.0, 2.5)
    with pytest.raises(ConfigError, match=r"^v\[1\]: "):
        numbers_in([1, math.nan], "v")


def test_thresholds_and_increasing():
    assert thresholds([0.1, 0.2], "t") == (0.1, 0.2) and increasing((1, 2, 3), "i") == (1, 2, 3)
    with pytest.raises(ConfigError, match="must be strictly increasing"):
        thresholds([0.2, 0.2], "t")
    with pytest.raises(ConfigError, match=r"t\[0\]: -0\.1 is outside \[0, inf\)"):
        thresholds([-0.1], "t")
    with pytest.raises(ConfigError, match="a ladder of 3 trees needs 2 thresholds, got 1"):
        thresholds([0.1], "t", count=2)
    with pytest.raises(ConfigError, match="must be a list of numbers"):
        thresholds(0.5, "t")


def test_taus():
    assert taus(0.2, 0.1) == (0.2, 0.1) and taus(None, 0.1) == (None, 0.1) and taus(None, None) == (None, None)
    with pytest.raises(ConfigError, match=r"^C\.tau_off: must be <= tau_on \(0\.1\), got 0\.2$"):
        taus(0.1, 0.2, prefix="C.")
    with pytest.raises(ConfigError, match=r"^C\.tau_on: "):
        taus(2.0, 0.1, high=1.0, prefix="C.")


def test_mapping():
    assert mapping({"a": 1}, "m") == {"a": 1} and mapping(None, "m", optional=True) == {}
    for bad in (1, True, [1], "x"):
        with pytest.raises(FieldError, match="^scheduler must be a JSON object or null, got"):
            mapping(bad, "scheduler", optional=True, error=FieldError)
    with pytest.raises(ConfigError, match="must be a JSON object, got None"):
        mapping(None, "m")


def test_brief_messages_stay_short():
    assert brief_repr(2**1000) == "<an integer of 1001 bits>" and len(brief_repr("x" * 10_000)) < 100
    assert brief_list(range(20), limit=3) == "0, 1, 2, ... (17 more)"
