"""Argument checks shared by every buffer (user errors name the argument and the expectation)."""

from typing import Any


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """`value` if it is an int >= `minimum`; `TypeError` / `ValueError` naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f'{name} must be an int, got {type(value).__name__} ({value!r})')
    if value < minimum:
        raise ValueError(f'{name} must be >= {minimum}, got {value}')
    return value
