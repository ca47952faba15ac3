"""How a parameter object refuses a value, in one place: the error names the class and field, the
value, and what is allowed (``SamplingParams.top_p=2 is invalid: must be in (0, 1]``)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
from typing import Any, TypeVar

_Params = TypeVar("_Params")


def named_keywords(cls: type[_Params]) -> type[_Params]:
    """Class decorator for a parameter dataclass: a keyword it has no field for stays Python's
    TypeError (vLLM's msgspec Structs raise one), but names the field it is close to and the fields
    taken, as ``LLM(...)`` does; Python's own message says only "unexpected keyword argument"."""
    init = cls.__init__
    known = frozenset(f.name for f in dataclasses.fields(cls) if f.init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{cls.__name__} got an unknown keyword argument {name!r}{hint} "
                                f"(its arguments: {sorted(known)})")
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def is_int(value: Any) -> bool:
    """An integer, and not a bool (vLLM's request models refuse True for an int field)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """An integer of Python's or another library's (numpy's), and not a bool: for the values vLLM
    takes without an isinstance check, so numpy's integers pass there."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, and not a bool (NaN and infinities included: callers bound the range)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_python_number(value: Any) -> Any:
    """An integer or real number of another library (numpy's, read from an array or a DataFrame) as the
    Python int or float it equals; anything else (bools, strings, None, lists) as it is, for the
    caller's checks to judge. vLLM's parameter objects are msgspec Structs, whose constructors check no
    types, so a field vLLM never isinstance-checks takes numpy's numbers; stored as Python numbers,
    the engine, outputs and JSON writers meet one kind."""
    if type(value) in (int, float) or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def is_foreign_int(value: Any) -> bool:
    """An integer that is no Python int (numpy's): what vLLM's ``isinstance(x, int)`` checks refuse."""
    return isinstance(value, numbers.Integral) and not isinstance(value, int)


def check(ok: bool, name: str, value: Any, allowed: str, owner: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: must be {allowed}")
