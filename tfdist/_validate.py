"""Argument checks shared by tfdist's constructors, with errors in Keras' words.

"Invalid value for argument `x`. Received: x=... Expected ..." names the argument,
quotes what was passed and says what is valid.
"""

from __future__ import annotations


def _fail(name: str, value, expected: str, where: str) -> ValueError:
    return ValueError(f"Invalid value for argument `{name}`{where}. Received: {name}={value!r}. Expected {expected}.")


def integer(name: str, value, *, minimum: int = 1, allow_none: bool = False, where: str = "") -> int | None:
    """Returns `value` if it is an int (not a bool) >= `minimum` (or None when allowed), else raises ValueError.

    Example:

    >>> integer("keep", 3)
    3
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer >= {minimum}" + (" (a positive integer)" if minimum == 1 else "")
        raise _fail(name, value, expected + (" or None" if allow_none else ""), where)
    return value


def positive_number(name: str, value, *, allow_none: bool = False, unit: str = "") -> float | None:
    """Returns `value` as a float if it is a number > 0 (or None when allowed), else raises ValueError.

    Example:

    >>> positive_number("timeout", 30, unit="seconds")
    30.0
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        expected = "a positive number" + (f" of {unit}" if unit else "") + (" or None" if allow_none else "")
        raise _fail(name, value, expected, "")
    return float(value)
