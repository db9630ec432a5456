"""Argument checks shared by tfdist's constructors, with errors in Keras' words.

"Invalid value for argument `x`. Received: x=... Expected ..." names the argument,
quotes what was passed and says what is valid.
"""

from __future__ import annotations

import sys

MAX_SECONDS = 1e9
"""The longest duration (about 31 years) that `positive_number(..., unit="seconds")` accepts.

In milliseconds or microseconds it still fits the 64-bit integers TensorFlow and the
operating system convert durations to.
"""


def invalid(name: str, value, expected: str, *, where: str = "", problem: str = "") -> ValueError:
    """The error for argument `name` (of `where`, e.g. " of load_corpus()"): what was received, what is valid.

    `problem` says what is wrong with `value` when its repr does not show it.

    Example:

    >>> invalid("devices", [], "a non-empty list of device names")
    ValueError('Invalid value for argument `devices`. Received: devices=[]. Expected a non-empty list of device names.')
    """
    received = f"{name}={value!r}" + (f"; {problem}" if problem else "")
    return ValueError(f"Invalid value for argument `{name}`{where}. Received: {received}. Expected {expected}.")


def is_integer(value, *, minimum: int | None = None, maximum: int | None = None) -> bool:
    """True if `value` is an int, not a bool, from `minimum` to `maximum` (each bound optional).

    Example:

    >>> is_integer(3, minimum=1), is_integer(True), is_integer(2.0), is_integer(70000, maximum=65535)
    (True, False, False, False)
    """
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (minimum is None or minimum <= value)
        and (maximum is None or value <= maximum)
    )


def is_number(value) -> bool:
    """True if `value` is an int or a float, not a bool (NaN and infinity included: compare them to a range).

    Example:

    >>> is_number(0.5), is_number(1), is_number(False), is_number("1")
    (True, True, False, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(
    name: str, value, *, minimum: int = 1, maximum: int | None = None, allow_none: bool = False, where: str = ""
) -> int | None:
    """Returns `value` if it is an int (not a bool) from `minimum` to `maximum` (or None when allowed), else raises.

    Raises:
        ValueError: naming `name`, the value and the valid range.

    Example:

    >>> integer("keep", 3)
    3
    >>> integer("n", 65, maximum=64)
    Traceback (most recent call last):
    ...
    ValueError: Invalid value for argument `n`. Received: n=65. Expected an integer from 1 to 64.
    """
    if value is None and allow_none:
        return None
    if not is_integer(value, minimum=minimum, maximum=maximum):
        if maximum is not None:
            expected = f"an integer from {minimum} to {maximum}"
        else:
            expected = f"an integer >= {minimum}" + (" (a positive integer)" if minimum == 1 else "")
        raise invalid(name, value, expected + (" or None" if allow_none else ""), where=where)
    return value


def positive_number(
    name: str, value, *, allow_none: bool = False, unit: str = "", maximum: float | None = None
) -> float | None:
    """Returns `value` as a float if it is a finite number > 0 (or None when allowed), else raises ValueError.

    NaN and infinity are rejected. Durations (`unit="seconds"`) are at most
    `MAX_SECONDS` unless `maximum` says otherwise.

    Raises:
        ValueError: naming `name`, the value and the valid range.

    Example:

    >>> positive_number("timeout", 30, unit="seconds")
    30.0
    >>> positive_number("scale", float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: Invalid value for argument `scale`. Received: scale=nan. Expected a positive, finite number.
    """
    if value is None and allow_none:
        return None
    if maximum is None and unit == "seconds":
        maximum = MAX_SECONDS
    limit = sys.float_info.max if maximum is None else maximum
    # The comparison is False for NaN, infinity and ints too large for a float.
    if not is_number(value) or not 0 < value <= limit:
        expected = "a positive, finite number" + (f" of {unit}" if unit else "")
        expected += "" if maximum is None else f", at most {maximum:g}"
        raise invalid(name, value, expected + (", or None" if allow_none else ""))
    return float(value)


def one_of(name: str, value, choices, *, where: str = ""):
    """Returns `value` if it is one of `choices` (compared with ==, never a bool for a non-bool choice), else raises.

    Raises:
        ValueError: naming `name`, the value and the choices.

    Example:

    >>> one_of("mode", "min", ("auto", "min", "max"))
    'min'
    >>> one_of("mode", "low", ("auto", "min", "max"))
    Traceback (most recent call last):
    ...
    ValueError: Invalid value for argument `mode`. Received: mode='low'. Expected one of ('auto', 'min', 'max').
    """
    choices = tuple(choices)
    if isinstance(value, bool) and not any(isinstance(c, bool) for c in choices) or value not in choices:
        raise invalid(name, value, f"one of {choices}", where=where)
    return value
