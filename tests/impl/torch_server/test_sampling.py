"""Sampling a batch of rows at once: which tokens each row may get under
top-k / top-p / min-p / banned tokens, and the logprob it reports (the
unfiltered log_softmax(logits / T))."""

from __future__ import annotations

import math

import pytest
import torch

from realrl.impl.generation.torch_server.protocol import Request
from realrl.impl.generation.torch_server.sampling import RowParams, sample_tokens

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([math.log(p) for p in PROBS])


def request(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0) -> Request:
    return Request(
        rid="r",
        input_ids=[0],
        max_new_tokens=1,
        min_new_tokens=0,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop_ids=frozenset(),
        return_logprob=True,
    )


def sample(requests: list[Request], logits: torch.Tensor, banned=None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return sample_tokens(logits, RowParams.from_requests(requests, torch.device("cpu")), generator, banned)


@pytest.mark.parametrize(
    "filters, allowed",
    [
        ({}, {0, 1, 2, 3}),
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),  # 0.5 ranked above token 1 is under 0.7; 0.8 above token 2 is not
        ({"top_p": 0.4}, {0}),
        ({"min_p": 0.5}, {0, 1}),  # kept: p >= 0.5 * 0.5
        ({"top_k": 3, "top_p": 0.7}, {0, 1}),
    ],
)
def test_filters_bound_the_tokens_and_logprobs_stay_unfiltered(filters, allowed):
    n = 2000
    tokens, logprobs = sample([request(**filters)] * n, LOGITS.expand(n, -1))
    assert set(tokens.tolist()) == allowed  # every allowed token turns up in 2000 draws, no other
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS, -1)[tokens])


def test_mixed_rows_greedy_tempered_and_banned():
    logits = torch.stack([LOGITS, LOGITS, LOGITS, 3 * LOGITS])
    requests = [request(temperature=0.0), request(temperature=0.0), request(top_k=1), request(temperature=0.5)]
    tokens, logprobs = sample(requests, logits, banned=[(1, [0, 1])])
    assert tokens[:3].tolist() == [0, 2, 0]  # greedy, greedy around banned tokens, top-1
    expected = [
        torch.log_softmax(LOGITS, -1)[0],
        torch.log_softmax(LOGITS, -1)[2],  # greedy rows: T = 1; a ban does not change the logprob
        torch.log_softmax(LOGITS, -1)[0],
        torch.log_softmax(3 * LOGITS / 0.5, -1)[tokens[3]],
    ]
    torch.testing.assert_close(logprobs, torch.stack(expected))


def test_banned_tokens_are_never_sampled():
    n = 500
    tokens, _ = sample([request()] * n, LOGITS.expand(n, -1), banned=[(i, [0, 2]) for i in range(n)])
    assert set(tokens.tolist()) == {1, 3}


def test_the_generator_makes_sampling_repeatable():
    n = 64
    first, _ = sample([request()] * n, LOGITS.expand(n, -1), seed=5)
    again, _ = sample([request()] * n, LOGITS.expand(n, -1), seed=5)
    other, _ = sample([request()] * n, LOGITS.expand(n, -1), seed=6)
    assert first.tolist() == again.tolist() != other.tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_refused(bad):
    logits = torch.stack([LOGITS, LOGITS.clone().index_fill(0, torch.tensor([1]), bad)])
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        sample([request(), request(temperature=0.0)], logits)
    with pytest.raises(FloatingPointError):
        sample([request()], torch.full((1, 4), float("-inf")))
