"""Sampling a batch of rows at once: which tokens each row may get under
top-k / top-p / min-p / banned tokens, and the two logprobs it reports: the
unfiltered log_softmax(logits / T), and the sampling logprob under the
filtered, renormalised distribution the token was drawn from."""

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
    tokens, logprobs, sampling_logprobs = sample([request(**filters)] * n, LOGITS.expand(n, -1))
    assert set(tokens.tolist()) == allowed  # every allowed token turns up in 2000 draws, no other
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS, -1)[tokens])
    # the sampling logprob: renormalised over the tokens the filters keep
    kept = torch.tensor(sorted(allowed))
    renormalised = LOGITS - torch.logsumexp(LOGITS[kept], -1)
    torch.testing.assert_close(sampling_logprobs, renormalised[tokens])


def test_top_p_frequencies_match_the_sampling_logprobs():
    """10k draws at top_p=0.5 from a 12-token distribution: each token's
    frequency is exp(its sampling logprob), within 4 standard errors; the
    unfiltered probability is far off (the old behaviour logprob)."""
    n = 10_000
    logits = torch.tensor([2.0, 1.7, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0])
    tokens, logprobs, sampling_logprobs = sample([request(top_p=0.5)] * n, logits.expand(n, -1), seed=1)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    frequency = counts / n
    drawn = tokens.unique()
    assert drawn.tolist() == [0, 1, 2]  # the nucleus: tokens 0, 1 hold 0.42 < top_p, with token 2 0.56
    p = torch.zeros(len(logits), dtype=torch.float64)
    for tok in drawn.tolist():
        values = sampling_logprobs[tokens == tok]
        assert torch.equal(values, values[:1].expand_as(values))  # one value per token
        p[tok] = math.exp(float(values[0]))
    assert abs(float(p.sum()) - 1.0) < 1e-6  # a distribution over the nucleus
    stderr = torch.sqrt(p * (1 - p) / n)
    assert torch.all((frequency - p).abs() <= 4 * stderr + 1e-12), (frequency, p)
    unfiltered = torch.softmax(logits.double(), -1)
    assert torch.all((frequency[drawn] - unfiltered[drawn]).abs() > 20 * stderr[drawn])
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[tokens])


def test_without_filters_the_sampling_logprob_is_the_logprob_bit_for_bit():
    """Unfiltered rows, alone or batched with filtered ones, at any temperature."""
    n = 300
    logits = torch.randn(n, 50, generator=torch.Generator().manual_seed(3)) * 3
    plain = [request(temperature=t) for t in (1.0, 0.7, 1.3)] * (n // 3)
    for requests in (plain, [r if i % 4 else request(top_p=0.5) for i, r in enumerate(plain)]):
        tokens, logprobs, sampling_logprobs = sample(requests, logits)
        unfiltered = torch.tensor([not r.needs_filter for r in requests])
        assert torch.equal(sampling_logprobs[unfiltered], logprobs[unfiltered])
        if not unfiltered.all():
            assert torch.all(sampling_logprobs[~unfiltered] > logprobs[~unfiltered])


def test_mixed_rows_greedy_tempered_and_banned():
    logits = torch.stack([LOGITS, LOGITS, LOGITS, 3 * LOGITS])
    requests = [request(temperature=0.0), request(temperature=0.0), request(top_k=1), request(temperature=0.5)]
    tokens, logprobs, sampling_logprobs = sample(requests, logits, banned=[(1, [0, 1]), (3, [1])])
    assert tokens[:3].tolist() == [0, 2, 0]  # greedy, greedy around banned tokens, top-1
    expected = [
        torch.log_softmax(LOGITS, -1)[0],
        torch.log_softmax(LOGITS, -1)[2],  # greedy rows: T = 1; a ban does not change the logprob
        torch.log_softmax(LOGITS, -1)[0],
        torch.log_softmax(3 * LOGITS / 0.5, -1)[tokens[3]],
    ]
    torch.testing.assert_close(logprobs, torch.stack(expected))
    # greedy and top-1 draws are certain; the banned row renormalises without its banned token
    allowed = torch.tensor([0, 2, 3])
    scaled = 3 * LOGITS / 0.5
    assert tokens[3] != 1
    expected_sampling = [0.0, 0.0, 0.0, scaled[tokens[3]] - torch.logsumexp(scaled[allowed], -1)]
    torch.testing.assert_close(sampling_logprobs, torch.stack([torch.as_tensor(x) for x in expected_sampling]))


def test_banned_tokens_are_never_sampled():
    n = 500
    tokens, _, _ = sample([request()] * n, LOGITS.expand(n, -1), banned=[(i, [0, 2]) for i in range(n)])
    assert set(tokens.tolist()) == {1, 3}


def test_the_generator_makes_sampling_repeatable():
    n = 64
    first, _, _ = sample([request()] * n, LOGITS.expand(n, -1), seed=5)
    again, _, _ = sample([request()] * n, LOGITS.expand(n, -1), seed=5)
    other, _, _ = sample([request()] * n, LOGITS.expand(n, -1), seed=6)
    assert first.tolist() == again.tolist() != other.tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_refused(bad):
    logits = torch.stack([LOGITS, LOGITS.clone().index_fill(0, torch.tensor([1]), bad)])
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        sample([request(), request(temperature=0.0)], logits)
    with pytest.raises(FloatingPointError):
        sample([request()], torch.full((1, 4), float("-inf")))
