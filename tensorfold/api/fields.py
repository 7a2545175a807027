"""Typed readers for decoded JSON request fields: the one place a JSON value becomes a Python
value or an ApiError(400) whose `param` names the field.

Invariants, for every reader:
- None (JSON null, or a key the body lacks) reads as None: "keep the default"; the caller
  decides what the default is. With required=True it is a 400 instead.
- A bool is never a number. Python's True is an int, so every numeric reader checks bool first.
- A string is never a number, even "0.5": clients that quote numbers get a 400, not a guess.
- NaN and the infinities are refused; json.loads accepts NaN, Infinity and -Infinity.
- An integral float (3.0, 1e3) reads as an int and any other float (2.5) is refused, which is
  what pydantic's lax mode (and so vLLM) accepts for an integer field.
"""
import math
from typing import Any

from tensorfold.api.errors import ApiError


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _expected(param: str, what: str, value: Any) -> ApiError:
    return ApiError(f"'{param}' must be {what}, got {json_type(value)}", param=param)


def _range_text(lo, hi, lo_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"> {lo}" if lo_open else f">= {lo}")
    if hi is not None:
        parts.append(f"<= {hi}")
    return " and ".join(parts)


def _check_range(x, param: str, lo, hi, lo_open: bool):
    below = lo is not None and (x <= lo if lo_open else x < lo)
    above = hi is not None and x > hi
    if below or above:
        raise ApiError(f"'{param}' must be {_range_text(lo, hi, lo_open)}, got {x!r}", param=param)
    return x


def _absent(value: Any, param: str, required: bool) -> bool:
    """True for None (read as None); a missing or null required field is a 400."""
    if value is None and required:
        raise ApiError(f"'{param}' is required", param=param)
    return value is None


def number(value: Any, param: str, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, required: bool = False) -> float | None:
    """A finite JSON number as a float, within [lo, hi] ((lo, hi] when lo_open)."""
    if _absent(value, param, required):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _expected(param, "a number", value)
    try:
        x = float(value)                 # a huge JSON int overflows here
    except OverflowError:
        raise ApiError(f"'{param}' is out of range", param=param) from None
    if not math.isfinite(x):
        raise ApiError(f"'{param}' must be a finite number, got {value!r}", param=param)
    return _check_range(x, param, lo, hi, lo_open)


def integer(value: Any, param: str, *, lo: int | None = None,
            hi: int | None = None, required: bool = False) -> int | None:
    """A JSON integer (or an integral float) as an int, within [lo, hi]."""
    if _absent(value, param, required):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _expected(param, "an integer", value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ApiError(f"'{param}' must be a finite integer, got {value!r}", param=param)
        if not value.is_integer():
            raise ApiError(f"'{param}' must be an integer, got {value!r}", param=param)
        value = int(value)
    return _check_range(value, param, lo, hi, False)


def boolean(value: Any, param: str, *, required: bool = False) -> bool | None:
    if _absent(value, param, required) or isinstance(value, bool):
        return value
    raise _expected(param, "a boolean", value)


def string(value: Any, param: str, *, choices: tuple[str, ...] | None = None,
           nonempty: bool = False, required: bool = False) -> str | None:
    if _absent(value, param, required):
        return None
    if not isinstance(value, str):
        raise _expected(param, "a string", value)
    if nonempty and not value:
        raise ApiError(f"'{param}' must not be empty", param=param)
    if choices is not None and value not in choices:
        raise ApiError(f"'{param}' must be one of {', '.join(choices)}; got {value!r}",
                       param=param)
    return value


def obj(value: Any, param: str, *, required: bool = False) -> dict | None:
    if _absent(value, param, required) or isinstance(value, dict):
        return value
    raise _expected(param, "an object", value)


def array(value: Any, param: str, *, nonempty: bool = False,
          max_len: int | None = None, required: bool = False) -> list | None:
    if _absent(value, param, required):
        return None
    if not isinstance(value, list):
        raise _expected(param, "an array", value)
    if nonempty and not value:
        raise ApiError(f"'{param}' must not be an empty array", param=param)
    if max_len is not None and len(value) > max_len:
        raise ApiError(f"'{param}' holds {len(value)} items; at most {max_len} are accepted",
                       param=param)
    return value


def same_value(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers: 0 is not false, 1 equals 1.0."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral
