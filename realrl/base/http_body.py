"""Reading a JSON request body safely: one helper for every realrl HTTP server.

    body = await read_json(request, max_bytes=MAX, max_depth=32)   # aiohttp
    body = parse_json(raw_bytes, max_bytes=MAX)                      # any framework

    req = from_json(ScheduleRequest, body)                           # typed, checked once

Either returns the decoded value (a dict unless `require_object=False`) or
raises `BodyError(message, status)`: 413 for a body over `max_bytes`, 400 for
everything else (empty, not UTF-8, not JSON, `NaN`/`Infinity` literals, nested
deeper than `max_depth`, not an object). Callers answer it as a client error.

**Typed bodies.** Request and response bodies are dataclasses (in `realrl/api/`);
`from_json(cls, value)` checks a decoded value against the class's annotations
and builds it, raising `BodyError` (400) that names the field path
(`rollouts[2].qid`). Types: `str`, `int` (never a JSON `true`; within int64),
`float` (an int is accepted; finite), `bool`, `Any`, `list[T]`, `dict[str, T]`,
`T | None`, `Literal[...]`, nested dataclasses. Bounds go in the field's
metadata through `rule(min=, max=, nonempty=)`. A field without a default is
required; `None` means absent. Unknown keys are refused unless the class sets
`UNKNOWN_FIELDS = "ignore"`. `to_json(obj)` is the inverse (None fields left out).

Why a depth limit: Python's `json` decoder recurses once per nesting level, so
`[[[[...]]]]` 100000 deep raises RecursionError (an HTTP 500), and even a
~900-deep value that does decode breaks later `repr`/`json.dumps` calls. The
depth is therefore checked *before* decoding, without recursion and at C
speed: string contents are cut out (escapes first, then every other quoted
segment), only brackets are kept, and the deepest level is the maximum of
their running +1/-1 sum (numpy).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from typing import Any, Literal, TypeVar

import numpy as np
from aiohttp import web

DEFAULT_MAX_DEPTH = 32

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_CURLY_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_CHUNK = 1 << 22


class BodyError(ValueError):
    """A request body the server refuses; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def nesting_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """True if the JSON text `raw` (UTF-8) may nest arrays/objects deeper than
    `max_depth`. Exact for well-formed JSON; for malformed JSON an upper bound
    of how deep a decoder gets before it finds the error. Never recurses."""
    # Inside strings a backslash pairs with the next character. Dropping `\\`
    # pairs first (left to right, as a lexer pairs them), then `\"`, leaves
    # exactly the quotes that open or close strings.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = b"".join(unescaped.split(b'"')[::2])
    brackets = outside_strings.translate(_CURLY_AS_SQUARE, _NOT_BRACKETS)
    if len(brackets) <= max_depth:
        return False
    # The depth after each bracket is the running sum of +1 ('[') / -1 (']');
    # summed in chunks, so a huge body needs no huge temporary.
    codes = np.frombuffer(brackets, dtype=np.uint8)
    level = 0
    for start in range(0, len(codes), _CHUNK):
        steps = np.where(codes[start : start + _CHUNK] == ord("["), 1, -1)
        depth = np.cumsum(steps, dtype=np.int64) + level
        if int(depth.max()) > max_depth:
            return True
        level = int(depth[-1])
    return False


def _reject_constant(name: str) -> Any:
    raise BodyError(f"invalid JSON: {name} is not a JSON number")


def parse_json(
    raw: bytes,
    *,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    allow_empty: bool = False,
    require_object: bool = True,
) -> Any:
    """Decode a request body; see the module docstring. An empty body is `{}`
    when `allow_empty`, an error otherwise."""
    if len(raw) > max_bytes:
        raise BodyError(f"request body of {len(raw)} bytes exceeds the limit of {max_bytes} bytes", 413)
    if not raw.strip():
        if allow_empty:
            return {}
        raise BodyError("empty request body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not UTF-8: {e}") from None
    if nesting_depth_exceeds(raw, max_depth):
        raise BodyError(f"request body is nested deeper than {max_depth} levels")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except BodyError:
        raise
    except (ValueError, RecursionError) as e:  # RecursionError: a last line of defence
        raise BodyError(f"invalid JSON: {e}") from None
    if require_object and not isinstance(value, dict):
        raise BodyError(f"the request body must be a JSON object, got a JSON {_json_type(value)}")
    return value


async def read_json(
    request: web.Request,
    *,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    allow_empty: bool = False,
    require_object: bool = True,
) -> Any:
    """`parse_json` of an aiohttp request's body. A declared Content-Length
    over the limit is refused before anything is read."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyError(f"request body of {request.content_length} bytes exceeds the limit of {max_bytes} bytes", 413)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # chunked bodies: aiohttp's client_max_size
        raise BodyError(f"request body exceeds the limit of {max_bytes} bytes", 413) from None
    return parse_json(
        raw, max_bytes=max_bytes, max_depth=max_depth, allow_empty=allow_empty, require_object=require_object
    )


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


# --------------------------------------------------------------------------- typed bodies

T = TypeVar("T")
_INT64 = 1 << 63


def rule(*, min: float | None = None, max: float | None = None, nonempty: bool = False) -> dict:
    """Field metadata for `from_json`: bounds of a number, or a non-empty str/list.
    `field(default=1, metadata=rule(min=1))`."""
    return {"http_body": {"min": min, "max": max, "nonempty": nonempty}}


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, dict, bool], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, hints[f.name], f.metadata.get("http_body") or {}, required))
    return tuple(out)


def from_json(cls: type[T], value: Any, path: str = "") -> T:
    """Builds dataclass `cls` from a decoded JSON value; see the module docstring."""
    if not isinstance(value, dict):
        raise BodyError(f"{_where(path, 'the request body')} must be a JSON object, got a JSON {_json_type(value)}")
    known = _fields(cls)
    if getattr(cls, "UNKNOWN_FIELDS", "reject") != "ignore":
        names = {name for name, *_ in known}
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise BodyError(f"{_where(path, 'the request body')} has unknown field(s) {', '.join(map(repr, unknown))}")
    kwargs = {}
    for name, kind, checks, required in known:
        field_path = f"{path}.{name}" if path else name
        if value.get(name) is None:
            if required:
                raise BodyError(f"missing field {field_path!r}")
            continue
        kwargs[name] = _convert(kind, value[name], field_path, checks)
    return cls(**kwargs)


def _convert(kind: Any, value: Any, path: str, checks: dict) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None:
            return None
        if len(options) == 1:
            return _convert(options[0], value, path, checks)
        for option in options:  # the first that fits
            try:
                return _convert(option, value, path, checks)
            except BodyError:
                continue
        raise BodyError(f"field {path!r} must be {' or '.join(_type_name(o) for o in options)}")
    if kind is Any:
        return value
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise BodyError(f"field {path!r} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(kind):
        return from_json(kind, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise BodyError(f"field {path!r} must be a list, got a JSON {_json_type(value)}")
        if checks.get("nonempty") and not value:
            raise BodyError(f"field {path!r} must be a non-empty list")
        (item,) = args or (Any,)
        return [_convert(item, v, f"{path}[{i}]", {}) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise BodyError(f"field {path!r} must be an object, got a JSON {_json_type(value)}")
        item = args[1] if args else Any
        return {k: _convert(item, v, f"{path}.{k}", {}) for k, v in value.items()}
    if kind is bool:
        if not isinstance(value, bool):
            raise BodyError(f"field {path!r} must be a boolean, got a JSON {_json_type(value)}")
        return value
    if kind is int:
        # bool is an int in Python; a JSON true is never a count or a version.
        if not isinstance(value, int) or isinstance(value, bool):
            raise BodyError(f"field {path!r} must be an integer, got a JSON {_json_type(value)}")
        if not -_INT64 <= value < _INT64:
            raise BodyError(f"field {path!r} is out of range")
        return _bounded(value, path, checks)
    if kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise BodyError(f"field {path!r} must be a finite number, got {_json_type(value)} {value!r}"[:200])
        return _bounded(float(value), path, checks)
    if kind is str:
        if not isinstance(value, str):
            raise BodyError(f"field {path!r} must be a string, got a JSON {_json_type(value)}")
        if checks.get("nonempty") and not value:
            raise BodyError(f"field {path!r} must be a non-empty string")
        return value
    raise TypeError(f"from_json: unsupported annotation {kind!r} at {path!r}")  # a bug in the contract class


def _bounded(value: float, path: str, checks: dict) -> Any:
    low, high = checks.get("min"), checks.get("max")
    if low is not None and value < low:
        raise BodyError(f"field {path!r} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise BodyError(f"field {path!r} must be <= {high}, got {value}")
    return value


def to_json(obj: Any) -> Any:
    """A dataclass (nested, in lists/dicts) as JSON-ready values; None fields are left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(v) for f in dataclasses.fields(obj) if (v := getattr(obj, f.name)) is not None}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    return obj


def _where(path: str, default: str) -> str:
    return f"field {path!r}" if path else default


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind))
