"""The torch server's /generate contract, without a server: what it accepts
(SGLang's fields, at their neutral values where it cannot honour others), what
it refuses and under which reason, and that the client's request and the
server's answer read the same fields on both sides."""

from __future__ import annotations

import json

import pytest

from realrl.api.generation_api import GenerationHyperparameters
from realrl.api.sglang_api import FinishReason, GenerateRequest
from realrl.base.http_body import BodyError, to_json
from realrl.impl.generation.client import GenerateResult
from realrl.impl.generation.torch_server.protocol import GenerateLimits, parse_generate_body

EOS = 1
LIMITS = GenerateLimits(vocab_size=64, max_positions=1000, eos_token_ids=frozenset({EOS}))


def parse(body: dict):
    return parse_generate_body(body, LIMITS)


def params_of(req) -> tuple:
    return (req.max_new_tokens, req.min_new_tokens, req.temperature, req.top_p, req.top_k, req.min_p, req.stop_ids)


def test_defaults_are_sglangs():
    (req,), batched = parse({"input_ids": [0, 5]})
    assert not batched and req.input_ids == [0, 5] and not req.return_logprob
    assert params_of(req) == (128, 0, 1.0, 1.0, -1, 0.0, frozenset({EOS}))
    assert len(req.rid) == 32  # made up when absent


def test_sglang_options_without_effect_are_accepted():
    plain = parse({"input_ids": [0, 5], "sampling_params": {"max_new_tokens": 4}})[0][0]
    neutral = {
        "max_new_tokens": 4,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1,
        "n": 1,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "stop": [],
    }
    body = {
        "input_ids": [0, 5],
        "sampling_params": neutral,
        "stream": False,
        "top_logprobs_num": 0,
        "logprob_start_len": -1,
        "return_text_in_logprobs": True,
    }
    (req,), _ = parse(body)
    assert params_of(req) == params_of(plain)
    (req,), _ = parse({"input_ids": [0, 5], "sampling_params": dict(neutral, stop="")})
    assert params_of(req) == params_of(plain)


def test_values_the_engine_reads():
    sampling = {"temperature": 0, "top_k": 0, "top_p": 0.5, "min_p": 0.1, "stop_token_ids": [7], "ignore_eos": True}
    (req,), _ = parse({"input_ids": [0], "sampling_params": sampling, "return_logprob": True, "rid": "r"})
    assert req.temperature == 0.0 and isinstance(req.temperature, float) and req.is_greedy
    assert req.top_k == -1  # 0 is off too
    assert req.stop_ids == frozenset({7})  # eos ignored
    assert req.return_logprob and req.rid == "r"
    (req,), _ = parse({"input_ids": [0], "sampling_params": {"top_k": 64}})
    assert req.top_k == -1 and not req.needs_filter  # keeps the whole vocabulary anyway


def test_batched_form_takes_one_value_or_one_per_prompt():
    body = {
        "input_ids": [[0, 1], [0, 2], [0, 3]],
        "sampling_params": [{"max_new_tokens": 2}, None, {"temperature": 0}],
        "return_logprob": [True, None, False],
        "rid": ["a", None, "c"],
    }
    reqs, batched = parse(body)
    assert batched and [r.input_ids for r in reqs] == body["input_ids"]
    assert [r.max_new_tokens for r in reqs] == [2, 128, 128] and reqs[2].is_greedy
    assert [r.return_logprob for r in reqs] == [True, False, False]
    assert reqs[0].rid == "a" and reqs[2].rid == "c" and len(reqs[1].rid) == 32
    shared, _ = parse({"input_ids": [[0, 1], [0, 1]], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True})
    assert [(r.max_new_tokens, r.return_logprob) for r in shared] == [(3, True), (3, True)]


GOOD = {"input_ids": [0, 5]}


def with_params(**params) -> dict:
    return dict(GOOD, sampling_params=params)


@pytest.mark.parametrize(
    "body, reason, words",
    [
        ({}, "empty", "input_ids must be a non-empty list"),
        ({"input_ids": []}, "empty", "input_ids must be a non-empty list"),
        ({"input_ids": [[0, 1], []]}, "empty", "every prompt must be a non-empty list"),
        ({"input_ids": [0, 64]}, "vocab", "token id 64 in input_ids is outside the vocabulary [0, 64)"),
        ({"input_ids": [0, True]}, "type", "input_ids[1]"),
        ({"input_ids": [[0], [1.5]]}, "type", "input_ids[1][0]"),
        ({"text": "hello"}, "unsupported", "no tokenizer"),
        (dict(GOOD, stream=True), "unsupported", "streaming"),
        (dict(GOOD, top_logprobs_num=5), "unsupported", "top_logprobs_num"),
        (dict(GOOD, bogus=1), "unknown_field", "'bogus'"),
        (with_params(no_such_param=1), "unknown_field", "'no_such_param'"),
        (with_params(frequency_penalty=0.5), "unsupported", "frequency_penalty=0.5"),
        (with_params(repetition_penalty=1.1), "unsupported", "repetition_penalty"),
        (with_params(n=2), "unsupported", "n=2"),
        (with_params(stop=["\n"]), "unsupported", "stop strings need a tokenizer"),
        (with_params(skip_special_tokens="yes"), "type", "skip_special_tokens"),
        (with_params(ignore_eos=1), "type", "ignore_eos"),
        (with_params(max_new_tokens="4"), "type", "max_new_tokens"),
        (with_params(max_new_tokens=-1), "range", "max_new_tokens"),
        (with_params(max_new_tokens=999), "too_long", "exceeds the model's 1000 positions"),
        (with_params(temperature=1e-6), "range", "temperature"),
        (with_params(top_k=True), "type", "top_k"),
        (with_params(top_k=2**70), "range", "top_k"),
        (with_params(max_new_tokens=3, min_new_tokens=5), "range", "min_new_tokens"),
        (with_params(min_new_tokens=2, stop_token_ids=list(range(64))), "range", "cover the whole vocabulary"),
        (with_params(stop_token_ids=[64]), "vocab", "stop_token_ids"),
        (dict(GOOD, sampling_params=[{}]), "type", "sampling_params is a list, but input_ids holds a single"),
        (dict(GOOD, return_logprob="yes"), "type", "return_logprob"),
        (dict(GOOD, rid=""), "type", "rid must be a non-empty string"),
        (dict(GOOD, rid=7), "type", "rid"),
        ({"input_ids": [[0], [1], [2]], "sampling_params": [{}, {}]}, "type", "2 entries for 3 prompts"),
        ({"input_ids": [[0], [1]], "rid": "x"}, "type", "rid must be a list of strings for a batched request"),
        ({"input_ids": [[0], [1]], "rid": ["x", "x"]}, "duplicate_rid", "duplicate rid"),
    ],
)
def test_refusals_say_why(body, reason, words):
    with pytest.raises(BodyError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.reason == reason and words in str(e.value), str(e.value)


def test_client_request_and_server_answer_agree_on_every_field():
    """What the client sends (GenerateRequest of a gconfig's sampling_params)
    is what the engine runs; what the engine answers is what the client reads."""
    gconfig = GenerationHyperparameters(
        max_new_tokens=9, min_new_tokens=2, temperature=0.5, top_p=0.9, top_k=5, stop_token_ids=[7, 8]
    )
    body = GenerateRequest(input_ids=[0, 5], sampling_params=gconfig.sampling_params(), return_logprob=True, rid="q/0")
    (req,), _ = parse(json.loads(json.dumps(to_json(body))))
    assert params_of(req) == (9, 2, 0.5, 0.9, 5, 0.0, frozenset({7, 8, EOS}))
    assert req.rid == "q/0" and req.return_logprob

    req.output_ids, req.output_logprobs = [3, 7], [-0.5, -1.25]
    answer = json.loads(json.dumps(to_json(req.response(FinishReason("stop", matched=7), "4"))))
    result = GenerateResult.from_response(answer)
    assert (result.output_ids, result.output_logprobs) == ([3, 7], [-0.5, -1.25])
    assert (result.finish_reason, result.matched_stop, result.weight_version, result.rid) == ("stop", 7, "4", "q/0")
    assert (result.prompt_tokens, result.completion_tokens) == (2, 2)
    req.return_logprob = False
    answer = to_json(req.response(FinishReason("abort", message="aborted"), "4"))
    assert "output_token_logprobs" not in answer["meta_info"] and answer["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "aborted",
    }


def test_an_answer_across_weight_updates_names_each_span_and_the_client_reads_it():
    """Outputs made before an update the request went on across are labelled with the old version
    (merged when an update kept the version); an answer of one version has no spans; the client
    reads the spans as per-token versions and refuses spans that do not cover the tokens exactly."""
    (req,), _ = parse({"input_ids": [0, 5], "return_logprob": True})
    req.output_ids += [7, 8]
    req.switch_version("0")
    req.output_ids += [9]
    req.switch_version("1")  # an update that failed: still version 1 afterwards
    req.output_ids += [10]
    req.switch_version("1")
    req.output_ids += [11, 12]
    req.output_logprobs += [-1.0] * 6
    req.output_sampling_logprobs += [-1.0] * 6
    answer = req.response(FinishReason("length"), "2")
    spans = [(s.version, s.start, s.end) for s in answer.meta_info.weight_versions]
    assert spans == [("0", 0, 2), ("1", 2, 4), ("2", 4, 6)] and answer.meta_info.weight_version == "2"
    result = GenerateResult.from_response(json.loads(json.dumps(to_json(answer))))
    assert result.output_versions == ["0", "0", "1", "1", "2", "2"] and result.weight_version == "2"
    # Aborted before it made a token under the new weights: the answer is the old version's.
    (early,), _ = parse({"input_ids": [0, 5]})
    early.output_ids += [7]
    early.switch_version("0")
    meta = early.response(FinishReason("abort"), "1").meta_info
    assert meta.weight_version == "0" and [(s.start, s.end) for s in meta.weight_versions] == [(0, 1)]
    (plain,), _ = parse({"input_ids": [0, 5]})
    plain.output_ids += [7]
    assert plain.response(FinishReason("length"), "3").meta_info.weight_versions is None
    bad = json.loads(json.dumps(to_json(answer)))
    bad["meta_info"]["weight_versions"][1]["start"] = 3  # a gap
    with pytest.raises(BodyError, match="does not follow"):
        GenerateResult.from_response(bad)
    bad["meta_info"]["weight_versions"] = bad["meta_info"]["weight_versions"][:1]
    with pytest.raises(BodyError, match="cover 2 of 6"):
        GenerateResult.from_response(bad)
