"""tfdist._validate: the argument checks every constructor shares, with errors in Keras' words."""

import math

import pytest

from tfdist import _validate


@pytest.mark.parametrize(
    "value, kwargs, expected",
    [
        (0, {}, r"Received: n=0\. Expected an integer >= 1 \(a positive integer\)\.$"),
        (True, {}, r"Received: n=True\. Expected an integer >= 1"),
        (2.0, {}, r"Received: n=2\.0\. Expected an integer >= 1"),
        ("3", {}, r"Received: n='3'\. Expected an integer >= 1"),
        (-1, {"minimum": 0}, r"Received: n=-1\. Expected an integer >= 0\.$"),
        (65, {"maximum": 64}, r"Received: n=65\. Expected an integer from 1 to 64\.$"),
        (3, {"minimum": 4, "maximum": 8}, r"Received: n=3\. Expected an integer from 4 to 8\.$"),
        (None, {}, r"Received: n=None\. Expected an integer >= 1 \(a positive integer\)\.$"),
        (0, {"allow_none": True}, r"Expected an integer >= 1 \(a positive integer\) or None\.$"),
        (0, {"where": " of f()"}, r"^Invalid value for argument `n` of f\(\)\. Received: n=0\."),
    ],
)
def test_integer_rejects(value, kwargs, expected):
    with pytest.raises(ValueError, match=expected) as raised:
        _validate.integer("n", value, **kwargs)
    assert str(raised.value).startswith("Invalid value for argument `n`")


def test_integer_accepts_the_bounds():
    assert _validate.integer("n", 1) == 1
    assert _validate.integer("n", 64, maximum=64) == 64
    assert _validate.integer("n", 0, minimum=0, maximum=0) == 0
    assert _validate.integer("n", None, allow_none=True) is None
    assert _validate.integer("n", 10**30) == 10**30


@pytest.mark.parametrize(
    "value, kwargs, ok",
    [
        (3, {}, True),
        (-3, {}, True),
        (True, {}, False),
        (3.0, {}, False),
        (None, {}, False),
        (0, {"minimum": 1}, False),
        (65535, {"minimum": 1, "maximum": 65535}, True),
        (65536, {"minimum": 1, "maximum": 65535}, False),
    ],
)
def test_is_integer(value, kwargs, ok):
    assert _validate.is_integer(value, **kwargs) is ok


@pytest.mark.parametrize("value, ok", [(0, True), (0.5, True), (math.nan, True), (False, False), ("1", False)])
def test_is_number(value, ok):
    assert _validate.is_number(value) is ok


def test_one_of():
    assert _validate.one_of("mode", "max", ["auto", "min", "max"]) == "max"
    assert _validate.one_of("flag", True, (True, False)) is True
    with pytest.raises(ValueError, match=r"^Invalid value for argument `mode`\. Received: mode='low'\. "
                                         r"Expected one of \('auto', 'min', 'max'\)\.$"):
        _validate.one_of("mode", "low", ("auto", "min", "max"))
    with pytest.raises(ValueError, match=r"Received: k=True\. Expected one of \(1, 2\)"):
        _validate.one_of("k", True, (1, 2))  # True == 1, but a bool is not a choice here
    with pytest.raises(ValueError, match=r"`kind` of g\(\)\. Received: kind=\[\]\."):
        _validate.one_of("kind", [], ("a",), where=" of g()")


def test_invalid_names_the_argument_the_value_and_the_problem():
    error = _validate.invalid("command", ["x"], "an executable", problem="'x' is not a program on PATH")
    assert str(error) == (
        "Invalid value for argument `command`. Received: command=['x']; 'x' is not a program on PATH. "
        "Expected an executable."
    )


@pytest.mark.parametrize(
    "value, kwargs, expected",
    [
        (0, {}, r"Received: t=0\. Expected a positive, finite number\.$"),
        (math.inf, {}, r"Received: t=inf\."),
        (math.nan, {}, r"Received: t=nan\."),
        (True, {}, r"Received: t=True\."),
        (2e9, {"unit": "seconds"}, r"Expected a positive, finite number of seconds, at most 1e\+09\.$"),
        (None, {}, r"Received: t=None\."),
    ],
)
def test_positive_number_rejects(value, kwargs, expected):
    with pytest.raises(ValueError, match=r"^Invalid value for argument `t`\. .*" + expected):
        _validate.positive_number("t", value, **kwargs)
