"""Reading a JSON request body safely: one helper for every realrl HTTP server.

    body = await read_json(request, max_bytes=MAX, max_depth=32)   # aiohttp
    body = parse_json(raw_bytes, max_bytes=MAX)                      # any framework

Either returns the decoded value (a dict unless `require_object=False`) or
raises `BodyError(message, status)`: 413 for a body over `max_bytes`, 400 for
everything else (empty, not UTF-8, not JSON, `NaN`/`Infinity` literals, nested
deeper than `max_depth`, not an object). Callers answer it as a client error.

Why a depth limit: Python's `json` decoder recurses once per nesting level, so
`[[[[...]]]]` 100000 deep raises RecursionError (an HTTP 500), and even a
~900-deep value that does decode breaks later `repr`/`json.dumps` calls. The
depth is therefore checked *before* decoding, without recursion and at C
speed: string contents are cut out (escapes first, then every other quoted
segment), only brackets are kept, and the deepest level is the maximum of
their running +1/-1 sum (numpy).
"""

from __future__ import annotations

import json
from typing import Any

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
