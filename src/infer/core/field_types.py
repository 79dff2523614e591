"""The number fields of a config or parameters dataclass, and the check that a value given for
one is of its type (not a string, a bool, or a float where an integer belongs): one rule for
``SamplingParams`` and the engine's configs, read from the fields' annotations."""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

_UNIONS = (typing.Union, types.UnionType)  # Optional[int] and int | None


@functools.cache
def number_fields(cls: type) -> tuple[tuple[str, bool, bool], ...]:
    """``(field, integer only, may be None)`` for each field of ``cls`` annotated int or float
    (optionally ``| None``): an int field takes only ints, a float field any number."""
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        allowed = set(typing.get_args(hint)) if typing.get_origin(hint) in _UNIONS else {hint}
        if allowed & {int, float} and allowed <= {int, float, type(None)}:
            out.append((name, float not in allowed, type(None) in allowed))
    return tuple(out)


def wrong_number_type(cls: type, values: dict[str, Any]) -> tuple[str, str] | None:
    """The first of ``values`` (field -> value) that is not of its number field's type, as
    ``(field, message)``; None when all are (a bool is never a number here)."""
    for name, integer, optional in number_fields(cls):
        if name not in values or (optional and values[name] is None):
            continue
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            what = "an integer" if integer else "a number"
            return name, f"{name} must be {what}, got {value!r}"
    return None
