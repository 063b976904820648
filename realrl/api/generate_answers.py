"""The torch server's columnar `/generate` answer: the same `GenerateResponse`s
as the JSON answer, with each answer's tokens and logprobs in flat binary
arrays (docs/design.md §6, "Columnar answers").

A client that can read it asks with `Accept: application/x-realrl-answers`
(`ANSWERS_MEDIA_TYPE`); the torch server (not emulating SGLang or vLLM)
then answers a 200 with that `Content-Type`, and every other answer (an
error, SGLang, vLLM, an emulation) stays JSON. The body, little-endian:

    b"RRA1" | u32 H | H bytes: the header, JSON (`AnswerColumns`)
    | int32 output_ids of every answer, in order
    | float64 logprob of every token of the answers with `logprobs`
    | float64 sampling logprob of every token of the answers with `sampling_logprobs`

Floats go as the server's own doubles (no decimal round trip), so the
client reads the same values as from JSON. `decode_answers` checks a body
as `from_json` checks a JSON answer (types, finite logprobs, every column
one entry per answer, the arrays exactly as long as the lengths say) and
raises `BodyError` for one that does not fit; no pickle, nothing executed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
from array import array
from itertools import repeat
from operator import itemgetter

from realrl.api.sglang_api import FinishReason, GenerateResponse, MetaInfo
from realrl.api.vllm_api import WeightVersionSpan
from realrl.base.http_body import BodyError, from_json, parse_json, to_json

ANSWERS_MEDIA_TYPE = "application/x-realrl-answers"
MAGIC = b"RRA1"
_HEAD = struct.Struct("<4sI")
_BIG_ENDIAN = sys.byteorder == "big"
assert array("i").itemsize == 4 and array("d").itemsize == 8
_first = itemgetter(0)


@dataclasses.dataclass
class AnswerColumns:
    """The header: per answer (one entry each, in prompt order) what
    `GenerateResponse` holds besides its token arrays. `batched`: the
    request was SGLang's list form (the JSON answer would be a list).
    Fields it does not name are ignored, as in the JSON answer."""

    UNKNOWN_FIELDS = "ignore"

    batched: bool
    lengths: list[int]  # output tokens per answer
    logprobs: list[bool]  # `output_token_logprobs` present (return_logprob)
    sampling_logprobs: list[bool]  # `output_token_sampling_logprobs` present
    id: list[str | None]
    finish_type: list[str | None]  # None: no finish_reason (SGLang's abort); else `FinishReason.type`
    finish_matched: list[int | None]  # the stop token (the torch server matches no stop strings)
    finish_message: list[str | None]
    prompt_tokens: list[int | None]
    completion_tokens: list[int | None]
    cached_tokens: list[int | None]
    weight_version: list[str | None]
    e2e_latency: list[float | None]
    # `weight_versions` of the answers that went on across a weight update: one entry per span, in order
    # (the answer's index, then its `WeightVersionSpan`); answers without spans have none here.
    span_answer: list[int] = dataclasses.field(default_factory=list)
    span_version: list[str] = dataclasses.field(default_factory=list)
    span_start: list[int] = dataclasses.field(default_factory=list)
    span_end: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        n, n_spans = len(self.lengths), len(self.span_answer)
        for f in dataclasses.fields(self):
            column = getattr(self, f.name)
            want = n_spans if f.name.startswith("span_") else n
            if isinstance(column, list) and len(column) != want:
                raise BodyError(f"answer column {f.name!r} has {len(column)} entries, not {want}", reason="type")
        if n and min(self.lengths) < 0:
            raise BodyError("answer column 'lengths' holds a negative length", reason="range")
        if n_spans and not (0 <= min(self.span_answer) and max(self.span_answer) < n):
            raise BodyError(f"answer column 'span_answer' names an answer outside 0..{n - 1}", reason="range")


def encode_answers(responses: list[GenerateResponse], batched: bool) -> bytes:
    """The columnar body of `responses` (a bare `finish_reason` string goes as
    `FinishReason(type=...)`, the only shape the torch server makes)."""
    ids, logprobs, sampling = array("i"), array("d"), array("d")
    lengths, has_lp, has_slp = [], [], []
    span_answer, span_version, span_start, span_end = [], [], [], []
    rid, ftype, matched, message = [], [], [], []
    prompt, completion, cached, version, latency = [], [], [], [], []
    for i, r in enumerate(responses):
        meta = r.meta_info
        out = r.output_ids or []
        ids.extend(out)
        lengths.append(len(out))
        triples = meta.output_token_logprobs
        has_lp.append(triples is not None)
        if triples is not None:
            if len(triples) != len(out):
                raise ValueError(f"answer {meta.id}: {len(triples)} logprobs for {len(out)} tokens")
            logprobs.extend(map(_first, triples))
        slps = meta.output_token_sampling_logprobs
        has_slp.append(slps is not None)
        if slps is not None:
            if len(slps) != len(out):
                raise ValueError(f"answer {meta.id}: {len(slps)} sampling logprobs for {len(out)} tokens")
            sampling.extend(slps)
        reason = meta.finish_reason
        if isinstance(reason, str):
            reason = FinishReason(reason)
        if reason is not None and not isinstance(reason.matched, (int, type(None))):
            raise ValueError(f"answer {meta.id}: matched {reason.matched!r} is no stop token")
        ftype.append(None if reason is None else reason.type)
        matched.append(None if reason is None else reason.matched)
        message.append(None if reason is None else reason.message)
        rid.append(meta.id)
        prompt.append(meta.prompt_tokens)
        completion.append(meta.completion_tokens)
        cached.append(meta.cached_tokens)
        version.append(meta.weight_version)
        latency.append(meta.e2e_latency)
        for span in meta.weight_versions or ():
            span_answer.append(i)
            span_version.append(span.version)
            span_start.append(span.start)
            span_end.append(span.end)
    header = AnswerColumns(
        batched=batched,
        lengths=lengths,
        logprobs=has_lp,
        sampling_logprobs=has_slp,
        id=rid,
        finish_type=ftype,
        finish_matched=matched,
        finish_message=message,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        weight_version=version,
        e2e_latency=latency,
        span_answer=span_answer,
        span_version=span_version,
        span_start=span_start,
        span_end=span_end,
    )
    head = json.dumps(to_json(header), separators=(",", ":"), allow_nan=False).encode()
    if _BIG_ENDIAN:
        for a in (ids, logprobs, sampling):
            a.byteswap()
    return b"".join((_HEAD.pack(MAGIC, len(head)), head, ids.tobytes(), logprobs.tobytes(), sampling.tobytes()))


def _column(raw: memoryview, typecode: str, start: int, count: int) -> list:
    a = array(typecode)
    a.frombytes(raw[start : start + count * a.itemsize])
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tolist()


def decode_answers(raw: bytes) -> tuple[list[GenerateResponse], bool]:
    """The answers of a columnar body and whether the request was batched;
    `BodyError` for a body that does not fit (see the module docstring)."""
    if len(raw) < _HEAD.size:
        raise BodyError(f"a columnar answer of {len(raw)} bytes has no header", reason="bad_body")
    magic, size = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise BodyError(f"a columnar answer starts with {magic!r}, not {MAGIC!r}", reason="bad_body")
    start = _HEAD.size + size
    if start > len(raw):
        raise BodyError(f"a columnar answer's header of {size} bytes runs past its {len(raw)} bytes", reason="bad_body")
    head = from_json(AnswerColumns, parse_json(raw[_HEAD.size : start], max_bytes=size))
    n_tokens = sum(head.lengths)
    n_lp = sum(k for k, has in zip(head.lengths, head.logprobs) if has)
    n_slp = sum(k for k, has in zip(head.lengths, head.sampling_logprobs) if has)
    if len(raw) - start != 4 * n_tokens + 8 * (n_lp + n_slp):
        raise BodyError(
            f"a columnar answer holds {len(raw) - start} bytes of arrays, its header says "
            f"{n_tokens} token ids, {n_lp} logprobs and {n_slp} sampling logprobs",
            reason="bad_body",
        )
    view = memoryview(raw)
    ids = _column(view, "i", start, n_tokens)
    lps = _column(view, "d", start + 4 * n_tokens, n_lp)
    slps = _column(view, "d", start + 4 * n_tokens + 8 * n_lp, n_slp)
    if not (all(map(math.isfinite, lps)) and all(map(math.isfinite, slps))):
        raise BodyError("a columnar answer holds a logprob that is not a finite number", reason="range")
    spans: dict[int, list[WeightVersionSpan]] = {}
    for i, version, first, end in zip(head.span_answer, head.span_version, head.span_start, head.span_end):
        spans.setdefault(i, []).append(WeightVersionSpan(version, first, end))
    responses = []
    at = at_lp = at_slp = 0
    for i, k in enumerate(head.lengths):
        out = ids[at : at + k]
        at += k
        triples = sampling_lps = None
        if head.logprobs[i]:
            triples = list(zip(lps[at_lp : at_lp + k], out, repeat(None)))
            at_lp += k
        if head.sampling_logprobs[i]:
            sampling_lps = slps[at_slp : at_slp + k]
            at_slp += k
        ftype = head.finish_type[i]
        meta = MetaInfo(
            id=head.id[i],
            finish_reason=None
            if ftype is None
            else FinishReason(ftype, head.finish_matched[i], head.finish_message[i]),
            prompt_tokens=head.prompt_tokens[i],
            completion_tokens=head.completion_tokens[i],
            cached_tokens=head.cached_tokens[i],
            weight_version=head.weight_version[i],
            e2e_latency=head.e2e_latency[i],
            output_token_logprobs=triples,
            output_token_sampling_logprobs=sampling_lps,
            weight_versions=spans.get(i),
        )
        responses.append(GenerateResponse(output_ids=out, meta_info=meta))
    return responses, head.batched
