"""The columnar /generate answer (docs/design.md §6): the same answers as the
JSON one, read back exactly; a body that does not fit is refused, never
half-read."""

from __future__ import annotations

import json
import math
import random
import struct

import pytest

from realrl.api.generate_answers import MAGIC, AnswerColumns, decode_answers, encode_answers
from realrl.api.sglang_api import FinishReason, GenerateResponse
from realrl.base.http_body import BodyError, to_json
from realrl.impl.generation.client import GenerateResult, _read
from realrl.impl.generation.torch_server.protocol import Request


def answers(n: int = 40, seed: int = 0) -> list[GenerateResponse]:
    """Answers as the torch server makes them: with and without logprobs,
    empty ones, aborted ones, ended by a stop token, across weight updates."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = Request(
            rid=f"{rng.getrandbits(128):032x}/q{i // 4}/{i % 4}",
            input_ids=[rng.randrange(3, 200) for _ in range(rng.randrange(1, 20))],
            max_new_tokens=16,
            min_new_tokens=0,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            min_p=0.0,
            stop_ids=frozenset({2}),
            return_logprob=i % 7 != 3,
        )
        for k in range(rng.choice([0, 1, 5, 16])):
            if k == 2 and i % 5 == 0:
                r.switch_version("4")  # a weight update while it ran: tokens [0, 2) are version 4's
            r.output_ids.append(rng.randrange(3, 200))
            r.output_logprobs.append(math.log(rng.random()))
            r.output_sampling_logprobs.append(r.output_logprobs[-1] * rng.choice([1.0, 0.5, 0.0]))
        reason = [FinishReason("length"), FinishReason("stop", matched=2), FinishReason("abort", message="update")][
            i % 3
        ]
        out.append(r.response(reason, "5"))
    return out


def test_the_columnar_answer_reads_back_as_the_json_one_does():
    responses = answers()
    assert any(r.meta_info.weight_versions for r in responses) and any(not r.output_ids for r in responses)
    for batched in (True, False):
        decoded, was_batched = decode_answers(encode_answers(responses, batched))
        assert was_batched is batched
        assert decoded == responses  # every field, logprobs bit for bit
    via_json = [
        GenerateResult.from_response(_read(GenerateResponse, b, "u", "/"))
        for b in json.loads(json.dumps(to_json(responses)))
    ]
    via_columns = [GenerateResult.from_response(r) for r in decode_answers(encode_answers(responses, True))[0]]
    assert via_columns == via_json
    assert [r.meta_info for r in via_columns] == [r.meta_info for r in via_json]
    assert [r.output_versions for r in via_columns] == [r.output_versions for r in via_json]
    assert decode_answers(encode_answers([], True)) == ([], True)


def _body(header: dict, arrays: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + arrays


def _header_of(body: bytes) -> tuple[dict, bytes]:
    (size,) = struct.unpack_from("<I", body, 4)
    return json.loads(body[8 : 8 + size]), body[8 + size :]


def test_a_body_that_does_not_fit_is_refused():
    sent = answers(6, seed=1)
    good = encode_answers(sent, batched=True)
    header, arrays = _header_of(good)
    assert decode_answers(_body(header, arrays))[0] == sent  # the helpers rebuild it exactly

    def changed(**fields) -> bytes:
        return _body({**header, **fields}, arrays)

    bad = {
        "empty": b"",
        "no header": MAGIC + b"\x00",
        "another format": b"RRA9" + good[4:],
        "header past the end": MAGIC + struct.pack("<I", len(good)) + good[8:],
        "header not JSON": MAGIC + struct.pack("<I", 3) + b"{no" + arrays,
        "header not an object": _body([1, 2]),  # type: ignore[arg-type]
        "a column missing": _body({k: v for k, v in header.items() if k != "lengths"}, arrays),
        "a column too short": changed(id=header["id"][:-1]),
        "a wrong type": changed(logprobs=[1] * len(header["logprobs"])),
        "a negative length": changed(lengths=[-1] + header["lengths"][1:]),
        "arrays shorter than the lengths": good[:-1],
        "arrays longer than the lengths": good + b"\x00" * 8,
        "a span of no answer": changed(span_answer=[99], span_version=["1"], span_start=[0], span_end=[1]),
        "span columns of different lengths": changed(span_answer=[0], span_version=[], span_start=[0], span_end=[1]),
        "a latency that is no number": changed(e2e_latency=["x"] * len(header["lengths"])),
    }
    for what, body in bad.items():
        with pytest.raises(BodyError):
            decode_answers(body)
            pytest.fail(what)
    # A logprob that is not a finite number (JSON has none to send)
    n_ids = sum(header["lengths"])
    for value in (math.nan, math.inf):
        poisoned = arrays[: 4 * n_ids] + struct.pack("<d", value) + arrays[4 * n_ids + 8 :]
        with pytest.raises(BodyError, match="finite"):
            decode_answers(_body(header, poisoned))


def test_the_header_names_every_column_once_per_answer():
    with pytest.raises(BodyError, match="'id'"):
        AnswerColumns(True, [1, 2], [True, True], [True, True], ["a"], *([[None, None]] * 8))
