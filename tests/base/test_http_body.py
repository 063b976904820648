"""The shared request-body reader: size, UTF-8, JSON, nesting depth, object type."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from typing import Literal

import aiohttp
import pytest
from aiohttp import web

from realrl.base.http_body import BodyError, from_json, nesting_depth_exceeds, parse_json, read_json, rule, to_json

LIMIT = 1 << 20


def nested(depth: int) -> str:
    """`depth` levels, arrays and objects alternating."""
    text = "0"
    for level in range(depth):
        text = f"[{text}]" if level % 2 else f'{{"k": {text}}}'
    return text


def reference_depth(text: str) -> int:
    """The deepest level a JSON lexer reaches before it stops at a backslash
    outside a string (where every decoder fails)."""
    depth = deepest = 0
    i, in_string = 0, False
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == "\\":
            break
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
        i += 1
    return deepest


def refused(raw: bytes, **kw) -> BodyError:
    with pytest.raises(BodyError) as e:
        parse_json(raw, max_bytes=kw.pop("max_bytes", LIMIT), **kw)
    return e.value


def test_depth_limit_is_exact_and_ignores_strings():
    assert parse_json(nested(8).encode(), max_bytes=LIMIT, max_depth=8, require_object=False) is not None
    assert "nested deeper than 8 levels" in str(refused(nested(9).encode(), max_depth=8, require_object=False))
    # Brackets, quotes and backslashes inside strings are not structure.
    tricky = {"a": "[[[[[[[[[[{{{{{{", "b": '\\"[[[[[[[[[[', "c": "\\\\", "d": ['"]]]]', '\\\\\\"']}
    assert parse_json(json.dumps(tricky).encode(), max_bytes=LIMIT, max_depth=2) == tricky


def test_deep_bodies_are_refused_without_recursion():
    deep = 100_000
    for raw in (
        b"[" * deep + b"]" * deep,
        b'{"a":' * deep + b"1" + b"}" * deep,
        b"[" * deep,  # never closed
        b'{"a": [1], "b": ' + b"[{" * deep,
        b'"\\\\" ' + b"[" * deep,  # an escaped backslash ends no string
    ):
        error = refused(raw, require_object=False)
        assert error.status == 400 and "nested deeper than" in str(error)


def test_depth_check_agrees_with_a_lexer_on_random_and_broken_json():
    rng = random.Random(0)
    leaves = [1, None, 2.5, "x{", 'a\\"[[', "]\\\\", '\\\\\\"', "[]{}"]

    def value(depth: int):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(leaves)
        if rng.random() < 0.5:
            return [value(depth - 1) for _ in range(rng.randint(0, 3))]
        return {f'k{i}["': value(depth - 1) for i in range(rng.randint(0, 3))}

    for _ in range(2000):
        text = json.dumps(value(rng.randint(0, 10)))
        broken = rng.random() < 0.5
        if broken:  # splice in stray brackets, quotes and backslashes
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(text) + 1)
                text = text[:i] + rng.choice('[{"\\]}') * rng.randint(1, 4) + text[i:]
        depth = reference_depth(text)
        for limit in range(12):
            exceeds = nesting_depth_exceeds(text.encode(), limit)
            if broken:
                assert exceeds or depth <= limit, (text, limit)  # never lets a deeper body through
            else:
                assert exceeds == (depth > limit), (text, limit)  # exact on valid JSON


def test_other_bad_bodies():
    assert "empty request body" in str(refused(b"  \n"))
    assert parse_json(b"", max_bytes=LIMIT, allow_empty=True) == {}
    assert "not UTF-8" in str(refused(b'{"a": "\xff"}'))
    assert "invalid JSON" in str(refused(b'{"a": 1'))
    assert "NaN is not a JSON number" in str(refused(b'{"a": NaN}'))
    assert "Infinity is not a JSON number" in str(refused(b'{"a": [-Infinity]}'))
    assert "must be a JSON object, got a JSON array" in str(refused(b"[1, 2]"))
    assert parse_json(b"[1, 2]", max_bytes=LIMIT, require_object=False) == [1, 2]
    too_big = refused(b'{"a": "' + b"x" * 100 + b'"}', max_bytes=50)
    assert too_big.status == 413 and "exceeds the limit of 50 bytes" in str(too_big)
    assert parse_json('{"ü": "ß"}'.encode(), max_bytes=LIMIT) == {"ü": "ß"}


def test_read_json_over_real_http():
    """An aiohttp app on 127.0.0.1 whose handler uses read_json: a declared
    Content-Length over the limit, a chunked body over it, a deep body, then a
    good one."""

    async def handler(request: web.Request) -> web.Response:
        try:
            body = await read_json(request, max_bytes=1000, max_depth=4)
        except BodyError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        return web.json_response({"echo": body})

    async def chunks():
        for _ in range(20):
            yield b" " * 100

    async def main():
        app = web.Application(client_max_size=1000)
        app.router.add_post("/", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
        answers = []
        try:
            async with aiohttp.ClientSession() as session:
                for data in (b"{" + b" " * 2000 + b"}", chunks(), b"[" * 10 + b"]" * 10, b'{"a": [1]}'):
                    async with session.post(url, data=data) as resp:
                        answers.append((resp.status, await resp.json()))
        finally:
            await runner.cleanup()
        return answers

    declared, chunked, deep, good = asyncio.run(main())
    assert declared[0] == 413 and "2002 bytes exceeds the limit of 1000" in declared[1]["error"]
    assert chunked[0] == 413 and "exceeds the limit of 1000 bytes" in chunked[1]["error"]
    assert deep[0] == 400 and "nested deeper than 4" in deep[1]["error"]
    assert good == (200, {"echo": {"a": [1]}})


# --------------------------------------------------------------------------- typed bodies


@dataclasses.dataclass
class _Part:
    qid: str = dataclasses.field(metadata=rule(nonempty=True))
    n: int = dataclasses.field(default=1, metadata=rule(min=1, max=64))


@dataclasses.dataclass
class _Body:
    name: str
    parts: list[_Part] = dataclasses.field(default_factory=list)
    weight: float = 1.0
    flag: bool = False
    mode: Literal["a", "b"] = "a"
    version: int | None = None
    extra: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Lenient:
    UNKNOWN_FIELDS = "ignore"
    x: int = 0


def test_from_json_builds_nested_dataclasses_and_round_trips():
    body = {"name": "a", "parts": [{"qid": "q", "n": 3}], "weight": 2, "version": 7, "extra": {"k": 1}}
    parsed = from_json(_Body, body)
    assert parsed == _Body(name="a", parts=[_Part("q", 3)], weight=2.0, version=7, extra={"k": 1})
    assert isinstance(parsed.weight, float)
    assert to_json(parsed) == {**body, "weight": 2.0, "flag": False, "mode": "a"}
    assert from_json(_Body, {"name": "a", "version": None}).version is None  # null = absent


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "missing field 'name'"),
        ({"name": 1}, "field 'name' must be a string"),
        ({"name": "a", "bogus": 1}, "unknown field(s) 'bogus'"),
        ({"name": "a", "parts": [{"qid": ""}]}, "field 'parts[0].qid' must be a non-empty string"),
        ({"name": "a", "parts": [{"qid": "q", "n": 0}]}, "field 'parts[0].n' must be >= 1"),
        ({"name": "a", "parts": [{"qid": "q", "n": 2**70}]}, "field 'parts[0].n' is out of range"),
        ({"name": "a", "parts": [{"qid": "q", "n": 65}]}, "field 'parts[0].n' must be <= 64"),
        ({"name": "a", "parts": [{"qid": "q", "n": True}]}, "field 'parts[0].n' must be an integer"),
        ({"name": "a", "parts": {"qid": "q"}}, "field 'parts' must be a list"),
        ({"name": "a", "weight": "1"}, "field 'weight' must be a finite number"),
        ({"name": "a", "flag": 1}, "field 'flag' must be a boolean"),
        # Plain scalar fields pass as they are only when exactly of their type and in range.
        ({"name": "a", "version": True}, "field 'version' must be int, got a JSON boolean"),
        ({"name": "a", "version": 2**70}, "field 'version' is out of range"),
        ({"name": "a", "version": 1.0}, "field 'version' must be an integer"),
        ({"name": "a", "weight": float("inf")}, "field 'weight' must be a finite number"),
        ({"name": "a", "parts": [{"qid": "q"}, {"qid": 5}]}, "field 'parts[1].qid' must be a string"),
        ({"name": "a", "mode": "c"}, "field 'mode' must be one of 'a', 'b'"),
        ({"name": "a", "extra": {"k": "v"}}, "field 'extra.k' must be an integer"),
        ([1], "the request body must be a JSON object"),
    ],
)
def test_from_json_names_the_bad_field(body, message):
    with pytest.raises(BodyError) as e:
        from_json(_Body, body)
    assert message in str(e.value) and e.value.status == 400


def test_from_json_may_ignore_unknown_fields():
    assert from_json(_Lenient, {"x": 2, "y": 3}) == _Lenient(x=2)


@dataclasses.dataclass
class _Shapes:
    ids: list[int] | list[list[int]]
    pairs: list[tuple[float, int, str | None]] = dataclasses.field(default_factory=list)
    either: _Part | list[_Part | None] | None = None


def test_unions_pick_the_option_by_json_shape_and_tuples_are_fixed_length():
    parsed = from_json(_Shapes, {"ids": [[0, 1], []], "pairs": [[-0.5, 3, None], [1, 4, "x"]], "either": [None]})
    assert parsed.ids == [[0, 1], []] and parsed.either == [None]
    assert parsed.pairs == [(-0.5, 3, None), (1.0, 4, "x")]
    assert to_json(parsed)["pairs"] == [[-0.5, 3, None], [1.0, 4, "x"]]
    assert from_json(_Shapes, {"ids": [], "either": {"qid": "q"}}) == _Shapes(ids=[], either=_Part("q"))


@pytest.mark.parametrize(
    "body, message",
    [
        # The first item tells one prompt from a batch, so the error names the bad item.
        ({"ids": [0, "a"]}, "field 'ids[1]' must be an integer, got a JSON string"),
        ({"ids": [[0], [1, True]]}, "field 'ids[1][1]' must be an integer, got a JSON boolean"),
        ({"ids": [0, [1]]}, "field 'ids[1]' must be an integer, got a JSON array"),
        ({"ids": [0, 2**70]}, "field 'ids[1]' is out of range"),
        ({"ids": [0, 1.0]}, "field 'ids[1]' must be an integer, got a JSON number"),
        ({"ids": "0 1"}, "field 'ids' must be list[int] or list[list[int]], got a JSON string"),
        ({"ids": [], "either": {"qid": ""}}, "field 'either.qid' must be a non-empty string"),
        ({"ids": [], "either": [{"bogus": 1}]}, "field 'either[0]' has unknown field(s) 'bogus'"),
        ({"ids": [], "pairs": [[-0.5, 3]]}, "field 'pairs[0]' must be a list of 3 items, got 2"),
        ({"ids": [], "pairs": [[-0.5, 3, 7]]}, "field 'pairs[0][2]' must be str"),
    ],
)
def test_union_and_tuple_errors_name_the_innermost_field(body, message):
    with pytest.raises(BodyError) as e:
        from_json(_Shapes, body)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"name": 1}, "type"),
        ({"name": "a", "weight": 10**400}, "range"),  # a JSON integer too big for a float: no OverflowError
        ({"name": "a", "parts": [{"qid": "q", "n": 0}]}, "range"),
        ({"name": "a", "parts": [{"qid": "q", "n": 2**70}]}, "range"),
        ({"name": "a", "mode": "c"}, "range"),
        ({"name": "a", "parts": [{"qid": ""}]}, "empty"),
        ({}, "missing"),
        ({"name": "a", "bogus": 1}, "unknown_field"),
    ],
)
def test_errors_carry_a_reason_for_rejection_counters(body, reason):
    with pytest.raises(BodyError) as e:
        from_json(_Body, body)
    assert e.value.reason == reason and e.value.status == 400
    assert refused(b"{").reason == refused(b"[1]").reason == "bad_json"
    assert refused(b"{}", max_bytes=1).reason == "too_large"


@dataclasses.dataclass
class _Reply:
    url: str | None = dataclasses.field(default=None, metadata=rule(keep_null=True))
    reason: str | None = None


@dataclasses.dataclass
class _Span:
    start: int
    end: int

    def __post_init__(self):
        if self.end < self.start:
            raise BodyError(f"field 'end' must be >= 'start', got {self.end} < {self.start}")


def test_to_json_keeps_the_nulls_it_is_told_to():
    assert to_json(_Reply()) == {"url": None}  # always there, null without a value
    assert to_json(_Reply("u", "r")) == {"url": "u", "reason": "r"}
    assert from_json(_Reply, to_json(_Reply())) == _Reply()


def test_a_check_across_fields_is_a_400():
    assert from_json(_Span, {"start": 1, "end": 2}) == _Span(1, 2)
    with pytest.raises(BodyError) as e:
        from_json(_Span, {"start": 2, "end": 1})
    assert "field 'end' must be >= 'start'" in str(e.value) and e.value.status == 400
