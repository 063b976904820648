"""Reading a JSON request body safely: one helper for every realrl HTTP server.

    body = await read_json(request, max_bytes=MAX, max_depth=32)   # aiohttp
    body = parse_json(raw_bytes, max_bytes=MAX)                      # any framework

    req = from_json(ScheduleRequest, body)                           # typed, checked once

Either returns the decoded value (a dict unless `require_object=False`) or
raises `BodyError(message, status, reason)`: 413 for a body over `max_bytes`
(reason `too_large`), 400 for everything else (empty, not UTF-8, not JSON,
`NaN`/`Infinity` literals, nested deeper than `max_depth`, not an object;
reason `bad_json`). Callers answer it as a client error; `reason` is a short
label for their rejection counters.

**Typed bodies.** Request and response bodies are dataclasses (in `realrl/api/`);
`from_json(cls, value)` checks a decoded value against the class's annotations
and builds it, raising `BodyError` (400) that names the field path
(`rollouts[2].qid`). Types: `str`, `int` (never a JSON `true`; within int64),
`float` (an int is accepted; finite), `bool`, `Any`, `list[T]`, `dict[str, T]`,
`tuple[A, B]` (an array of exactly those items), `Literal[...]`, nested
dataclasses, and unions of these (`T | None`, `list[int] | list[list[int]]`):
the options whose JSON shape matches the value (object, array, string, number
or boolean, and for an array the shape of its first item) are tried in order,
and when none converts, the first one's error is raised, so the message names
the innermost bad field. Bounds go in the field's metadata through
`rule(min=, max=, nonempty=)`. A field without a default is required; `None`
means absent. Unknown keys are refused unless the class sets
`UNKNOWN_FIELDS = "ignore"`. The error's `reason` says which check failed:
`type`, `range`, `empty`, `missing` or `unknown_field`. A check across fields
goes in the class's `__post_init__`, raising `BodyError`. `to_json(obj)` is the
inverse: None fields are left out, except those marked `rule(keep_null=True)`
(a reply whose field is always there, null when it has no value).

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
import itertools
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
    """A request body the server refuses; `status` is the HTTP status to answer,
    `reason` a short label for rejection counters (`invalid` unless given;
    `too_large` for a 413)."""

    def __init__(self, message: str, status: int = 400, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason or ("too_large" if status == 413 else "invalid")


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
    raise BodyError(f"invalid JSON: {name} is not a JSON number", reason="bad_json")


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
        raise BodyError("empty request body", reason="bad_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not UTF-8: {e}", reason="bad_json") from None
    if nesting_depth_exceeds(raw, max_depth):
        raise BodyError(f"request body is nested deeper than {max_depth} levels", reason="bad_json")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except BodyError:
        raise
    except (ValueError, RecursionError) as e:  # RecursionError: a last line of defence
        raise BodyError(f"invalid JSON: {e}", reason="bad_json") from None
    if require_object and not isinstance(value, dict):
        raise BodyError(f"the request body must be a JSON object, got a JSON {_json_type(value)}", reason="bad_json")
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
    if isinstance(value, dict):
        return "object"
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


def rule(
    *, min: float | None = None, max: float | None = None, nonempty: bool = False, keep_null: bool = False
) -> dict:
    """Field metadata for `from_json`: bounds of a number, or a non-empty str/list;
    for `to_json`, `keep_null` writes None as null instead of leaving the field out.
    `field(default=1, metadata=rule(min=1))`."""
    return {"http_body": {"min": min, "max": max, "nonempty": nonempty, "keep_null": keep_null}}


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, dict, bool, type | None], ...]:
    """Per init field: name, annotation, checks, whether required, and the
    scalar type whose values pass as they are (`str`, `int`, `bool`, `float`,
    or one of those or None, with no checks; else None)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        checks = f.metadata.get("http_body") or {}
        out.append((f.name, hints[f.name], checks, required, _plain_scalar(hints[f.name], checks)))
    return tuple(out)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(name for name, *_ in _fields(cls))


def _plain_scalar(kind: Any, checks: dict) -> type | None:
    if checks.get("min") is not None or checks.get("max") is not None or checks.get("nonempty"):
        return None
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = options[0] if len(options) == 1 else None
    return kind if kind in _SCALARS else None


def from_json(cls: type[T], value: Any, path: str = "") -> T:
    """Builds dataclass `cls` from a decoded JSON value; see the module docstring."""
    if not isinstance(value, dict):
        raise BodyError(
            f"{_where(path, 'the request body')} must be a JSON object, got a JSON {_json_type(value)}", reason="type"
        )
    known = _fields(cls)
    if getattr(cls, "UNKNOWN_FIELDS", "reject") != "ignore" and not value.keys() <= _field_names(cls):
        unknown = sorted(str(k) for k in value.keys() - _field_names(cls))
        raise BodyError(
            f"{_where(path, 'the request body')} has unknown field(s) {', '.join(map(repr, unknown))}",
            reason="unknown_field",
        )
    kwargs = {}
    for name, kind, checks, required, scalar in known:
        v = value.get(name)
        if v is None:
            if required:
                raise BodyError(f"missing field {f'{path}.{name}' if path else name!r}", reason="missing")
            continue
        # A value of exactly its plain scalar type passes as it is (a JSON body holds
        # thousands of them: a routing table, a batch's answers); anything else is checked.
        if (
            type(v) is scalar
            and (scalar is not int or -_INT64 <= v < _INT64)
            and (scalar is not float or math.isfinite(v))
        ):
            kwargs[name] = v
        else:
            kwargs[name] = _convert(kind, v, f"{path}.{name}" if path else name, checks)
    return cls(**kwargs)


@functools.cache
def _shape(kind: Any) -> tuple[Any, tuple, tuple | None, bool]:
    """`kind`'s origin, its arguments, for a union its options but None (else None), and whether
    it is a dataclass: worked out once per annotation, not once per value (a batch of answers
    holds thousands of values)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    options = tuple(a for a in args if a is not type(None)) if origin in (typing.Union, types.UnionType) else None
    return origin, args, options, dataclasses.is_dataclass(kind)


def _convert(kind: Any, value: Any, path: str, checks: dict) -> Any:
    origin, args, options, is_dataclass = _shape(kind)
    if options is not None:
        if value is None:
            return None
        if len(options) == 1 and _fits(options[0], value):  # `T | None`: what the loop below does, without it
            return _convert(options[0], value, path, checks)
        fitting = [o for o in options if _fits(o, value)]
        if not fitting:
            names = " or ".join(_type_name(o) for o in options)
            raise BodyError(f"field {path!r} must be {names}, got a JSON {_json_type(value)}", reason="type")
        errors = []
        for option in fitting:  # the first that fits
            try:
                return _convert(option, value, path, checks)
            except BodyError as e:
                errors.append(e)
        raise errors[0]
    if kind is Any:
        return value
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise BodyError(
                f"field {path!r} must be one of {', '.join(map(repr, args))}, got {value!r}", reason="range"
            )
        return value
    if is_dataclass:
        return from_json(kind, value, path)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise BodyError(f"field {path!r} must be a list, got a JSON {_json_type(value)}", reason="type")
        if checks.get("nonempty") and not value:
            raise BodyError(f"field {path!r} must be a non-empty list", reason="empty")
        if origin is list:
            (item,) = args or (Any,)
            fast = _fast_list(item, value)
            if fast is not None:
                return fast
            if _shape(item)[3]:
                return [from_json(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return [_convert(item, v, f"{path}[{i}]", {}) for i, v in enumerate(value)]
        if len(value) != len(args):
            raise BodyError(f"field {path!r} must be a list of {len(args)} items, got {len(value)}", reason="type")
        return tuple(_convert(item, v, f"{path}[{i}]", {}) for i, (item, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise BodyError(f"field {path!r} must be an object, got a JSON {_json_type(value)}", reason="type")
        item = args[1] if args else Any
        return {k: _convert(item, v, f"{path}.{k}", {}) for k, v in value.items()}
    if kind is bool:
        if not isinstance(value, bool):
            raise BodyError(f"field {path!r} must be a boolean, got a JSON {_json_type(value)}", reason="type")
        return value
    if kind is int:
        # bool is an int in Python; a JSON true is never a count or a version.
        if not isinstance(value, int) or isinstance(value, bool):
            raise BodyError(f"field {path!r} must be an integer, got a JSON {_json_type(value)}", reason="type")
        if not -_INT64 <= value < _INT64:
            raise BodyError(f"field {path!r} is out of range", reason="range")
        return _bounded(value, path, checks)
    if kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise BodyError(f"field {path!r} must be a finite number, got a JSON {_json_type(value)}", reason="type")
        try:
            number = float(value)  # a huge JSON integer overflows here
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise BodyError(f"field {path!r} must be a finite number, got {value!r}"[:200], reason="range")
        return _bounded(number, path, checks)
    if kind is str:
        if not isinstance(value, str):
            raise BodyError(f"field {path!r} must be a string, got a JSON {_json_type(value)}", reason="type")
        if checks.get("nonempty") and not value:
            raise BodyError(f"field {path!r} must be a non-empty string", reason="empty")
        return value
    raise TypeError(f"from_json: unsupported annotation {kind!r} at {path!r}")  # a bug in the contract class


_SCALARS = {int: int, float: float, str: str, bool: bool}


def _fast_list(item: Any, value: list | tuple) -> list | None:
    """`value` as a `list[item]` without a call per item (token ids and
    logprobs come by the thousand), or None: an item that does not fit
    exactly, or an item type without a fast path, takes the item-by-item
    path, which converts it or names the bad item."""
    origin, args, options, _ = _shape(item)
    if options is not None:
        if len(options) != 1 or options[0] not in _SCALARS:
            return None
        present = [v for v in value if v is not None]
        return list(value) if _fast_list(options[0], present) is not None else None
    if item in _SCALARS:
        if not all(type(v) is item for v in value):  # exact: no bool for int, no int for float
            return None
        if item is int and value and not (-_INT64 <= min(value) and max(value) < _INT64):
            return None
        if item is float and not all(map(math.isfinite, value)):
            return None
        return list(value)
    if origin is tuple:
        kinds = args
        if not all(type(v) is list and len(v) == len(kinds) for v in value):
            return None
        columns = [_fast_list(kind, column) for kind, column in zip(kinds, zip(*value))]
        if any(column is None for column in columns):
            return None
        return list(zip(*columns)) if value else []
    return None


def _bounded(value: float, path: str, checks: dict) -> Any:
    low, high = checks.get("min"), checks.get("max")
    if low is not None and value < low:
        raise BodyError(f"field {path!r} must be >= {low}, got {value}", reason="range")
    if high is not None and value > high:
        raise BodyError(f"field {path!r} must be <= {high}, got {value}", reason="range")
    return value


def _fits(kind: Any, value: Any) -> bool:
    """Whether `value` has the JSON shape of `kind`: its kind, and for a
    non-empty array, that of its first item (as SGLang tells a batch of
    prompts from one prompt)."""
    if _json_type(value) not in _json_kinds(kind):
        return False
    origin, args, _, _ = _shape(kind)
    if origin is list and value:
        (item,) = args or (Any,)
        return _fits(item, value[0])
    return True


@functools.cache
def _json_kinds(kind: Any) -> frozenset[str]:
    """The JSON kinds a value of annotation `kind` can come as."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return frozenset({"object", "array", "string", "number", "boolean", "null"})
    if origin in (typing.Union, types.UnionType):
        return frozenset().union(*(_json_kinds(a) for a in typing.get_args(kind)))
    if origin is Literal:
        return frozenset(_json_type(a) for a in typing.get_args(kind))
    if dataclasses.is_dataclass(kind) or origin is dict:
        return frozenset({"object"})
    if origin in (list, tuple):
        return frozenset({"array"})
    return frozenset(
        {{bool: "boolean", int: "number", float: "number", str: "string", type(None): "null"}.get(kind, "?")}
    )


_PLAIN = (str, int, float, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)


@functools.cache
def _keep_null(cls: type) -> frozenset[str]:
    """The fields of dataclass `cls` that `to_json` writes as null when None."""
    return frozenset(f.name for f in dataclasses.fields(cls) if (f.metadata.get("http_body") or {}).get("keep_null"))


@functools.cache
def _json_fields(cls: type) -> tuple[tuple[str, bool], ...] | None:
    """(name, written as null when None) of each field of dataclass `cls`, in order; None if
    `cls` is no dataclass. Worked out once per class (an answer of 128 prompts holds hundreds)."""
    if not dataclasses.is_dataclass(cls):
        return None
    keep = _keep_null(cls)
    return tuple((f.name, f.name in keep) for f in dataclasses.fields(cls))


def to_json(obj: Any) -> Any:
    """A dataclass (nested, in lists/dicts) as JSON-ready values; None fields are
    left out unless marked `rule(keep_null=True)`."""
    kind = type(obj)
    if kind in _PLAIN_TYPES:
        return obj
    if isinstance(obj, (list, tuple)):
        # Token ids, logprobs, (logprob, id, text) triples: no call per item.
        kinds = set(map(type, obj))
        if kinds <= _PLAIN_TYPES:
            return list(obj)
        if kinds == {tuple} and set(map(type, itertools.chain.from_iterable(obj))) <= _PLAIN_TYPES:
            return [list(v) for v in obj]
        return [to_json(v) for v in obj]
    fields = _json_fields(kind)
    if fields is not None:
        out = {}
        for name, keep in fields:
            v = getattr(obj, name)
            if v is not None:
                out[name] = v if type(v) in _PLAIN_TYPES else to_json(v)
            elif keep:
                out[name] = None
        return out
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    return obj


def _where(path: str, default: str) -> str:
    return f"field {path!r}" if path else default


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is not None:  # list[int], dict[str, int], ...
        return str(kind).replace("typing.", "")
    return getattr(kind, "__name__", str(kind))
