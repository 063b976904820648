import numpy as np
import pytest

from realrl.api.agent_api import AGENTS, register_agent
from realrl.api.trajectory import Sampling, Trajectory, TrajectoryError
from realrl.base import wire
from realrl.base.registry import Registry


def make_traj(n=3) -> Trajectory:
    rng = np.random.default_rng(0)
    ids, lps, vers = [], [], []
    for i in range(n):
        plen, glen = 5, 3 + i
        ids.append(rng.integers(0, 50, plen + glen).astype(np.int32))
        lps.append(-rng.random(glen).astype(np.float32))
        vers.append(np.array([1] * (glen - 1) + [2], dtype=np.int32))
    return Trajectory(
        qid="q1",
        task="math",
        birth_time=12.5,
        input_ids=ids,
        prompt_len=[5] * n,
        logprobs=lps,
        versions=vers,
        version_start=[1] * n,
        version_end=[2] * n,
        reward=[1.0, -1.0, 1.0][:n],
        no_eos=[False, True, False][:n],
        metadata={"answer": "7"},
    )


def test_wire_round_trip_is_exact():
    t = make_traj().validate()
    back = Trajectory.from_wire(t.to_wire())
    assert back.qid == "q1" and back.metadata == {"answer": "7"} and back.birth_time == 12.5
    for a, b in zip(t.input_ids + t.logprobs + t.versions, back.input_ids + back.logprobs + back.versions):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert back.reward == t.reward and back.no_eos == t.no_eos and back.n_tokens == t.n_tokens
    assert back.min_version_start == 1 and back.group_size == 3
    t.rollout_id, t.index, t.rollout_size = "0:1:2", 1, 3
    assert Trajectory.from_wire(t.to_wire()).rollout_size == 3  # how many its rollout returned (§12)


def with_sampling(t: Trajectory) -> Trajectory:
    """Sampling logprobs above the logprobs (mass was cut), one temperature per sequence."""
    t.sampling_logprobs = [lp / 2 for lp in t.logprobs]
    t.sampling = [Sampling(0.7, top_p=0.5), Sampling(1.0), Sampling(0.0, top_k=40, min_p=0.1)][: t.group_size]
    return t.validate()


def test_sampling_logprobs_and_parameters_cross_the_wire_exactly():
    t = with_sampling(make_traj())
    back = Trajectory.from_wire(wire.decode(wire.encode(t.to_wire())))
    assert back.sampling == t.sampling  # temperatures exactly as sent (float64 on the wire)
    assert back.sampling[0].temperature == 0.7 and back.sampling[2].logprob_temperature == 1.0
    for a, b in zip(t.sampling_logprobs, back.sampling_logprobs):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b)
    assert np.array_equal(back.behaviour_logprobs(1), t.sampling_logprobs[1])
    plain = Trajectory.from_wire(make_traj().to_wire())  # recorded by neither: empty, logprobs stand in
    assert plain.sampling == [] and plain.sampling_logprobs == []
    assert np.array_equal(plain.behaviour_logprobs(1), plain.logprobs[1])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda w: w.update(sampling_logprobs=w["sampling_logprobs"][:-1]), "sampling_logprobs"),
        (lambda w: w.update(sampling=w["sampling"][:-1]), "sampling"),
        (lambda w: w.update(sampling=w["sampling"].astype(np.float32)), "float64"),
        (lambda w: w["sampling"].__setitem__(0, -1.0), "impossible sampling"),
        (lambda w: w["sampling"].__setitem__(2, 2.5), "top_k"),
        (lambda w: w["sampling_logprobs"].__setitem__(0, np.inf), "non-finite sampling_logprobs"),
    ],
)
def test_malformed_sampling_fields_are_rejected(mutate, message):
    w = with_sampling(make_traj()).to_wire()
    mutate(w)
    with pytest.raises(TrajectoryError, match=message):
        Trajectory.from_wire(w)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda w: w.update(seq_lens=w["seq_lens"] + 1), "add up"),
        (lambda w: w.update(logprobs=w["logprobs"][:-1]), "lengths"),
        (lambda w: w.update(input_ids=w["input_ids"].astype(np.int64)), "int32"),
        (lambda w: w.update(reward=[1.0, 2.0, 3.0]), "reward"),
        (lambda w: w.pop("qid"), "qid"),
        (lambda w: w.update(prompt_len=np.array([5, 5, 50], dtype=np.int32)), "prompt_len"),
        (lambda w: w.update(version_start=np.array([3, 1, 1], dtype=np.int32)), "version_start"),
        (lambda w: w.update(index=2, rollout_size=2), "rollout_size must be an int above its index 2"),
        (lambda w: w.update(rollout_size=0), "rollout_size"),
        (lambda w: w.update(rollout_size=True), "rollout_size"),
    ],
)
def test_malformed_wire_messages_are_rejected(mutate, message):
    w = make_traj().to_wire()
    mutate(w)
    with pytest.raises(TrajectoryError, match=message):
        Trajectory.from_wire(w)


def test_nan_logprob_rejected():
    t = make_traj()
    t.logprobs[0][0] = np.nan
    with pytest.raises(TrajectoryError, match="non-finite"):
        t.validate()


@pytest.mark.parametrize(
    "seq, pos", [(0, 0), (1, 4), (1, 5), (2, -1)]
)  # prompt, last prompt, first and last completion
@pytest.mark.parametrize("bad", [50, -1, 2**31 - 1, -(2**31)])
def test_token_ids_outside_the_vocabulary_are_rejected(seq, pos, bad):
    w = make_traj().to_wire()  # token ids in 0..49
    t = Trajectory.from_wire(w)
    t.input_ids[seq][pos] = bad
    with pytest.raises(TrajectoryError, match=f"token id {bad} .*outside the vocabulary 0..49"):
        t.check_token_ids(50)
    assert t.check_token_ids(None) is t  # no vocabulary known: nothing to check
    t.validate()  # well-formed all the same: only the vocabulary check catches it


def test_token_ids_at_the_vocabulary_bounds_are_accepted():
    t = make_traj()
    t.input_ids[0][0], t.input_ids[1][-1] = 0, 49
    assert Trajectory.from_wire(t.to_wire()).check_token_ids(50).n_tokens == t.n_tokens
    with pytest.raises(TrajectoryError, match="token id 49"):
        t.check_token_ids(49)


def test_registry_errors_list_registered_names():
    reg = Registry("widget")
    reg.register("a", dict)
    with pytest.raises(ValueError, match=r"already registered.*\['a'\]"):
        reg.register("a", list)
    with pytest.raises(KeyError, match=r"unknown widget 'b'; registered: \['a'\]"):
        reg.make("b")
    register_agent("test-dummy-agent", dict)
    assert "test-dummy-agent" in AGENTS


def test_check_trainable_takes_context_versions_inside_a_chain():
    """A chain of chat turns (docs/design.md §5) holds context tokens with
    version -1 and loss mask False: trainable. A sampled token with version
    -1 is not."""

    def chain(versions, mask):
        n = len(versions)
        return Trajectory(
            qid="q@0",
            task="math",
            birth_time=0.0,
            input_ids=[np.arange(3 + n, dtype=np.int32)],
            prompt_len=[3],
            logprobs=[np.where(mask, -0.5, 0.0).astype(np.float32)],
            versions=[np.asarray(versions, dtype=np.int32)],
            version_start=[0],
            version_end=[1],
            reward=[1.0],
            no_eos=[False],
            loss_mask=[np.asarray(mask, dtype=bool)],
        )

    chain([0, 0, -1, -1, 1], [True, True, False, False, True]).check_trainable(100, 64, newest_version=1)
    with pytest.raises(TrajectoryError, match="weight versions"):
        chain([0, -1, -1, -1, 1], [True, True, False, False, True]).check_trainable(100, 64, newest_version=1)


@pytest.mark.parametrize(
    "breaks, message",
    [
        (lambda t: t.input_ids[1].__setitem__(6, 50), "seq 1: token id 50 at position 6"),
        (lambda t: t.versions[2].__setitem__(0, 7), "seq 2: weight versions 1..7 outside 0..3"),
        (lambda t: t.logprobs[1].__setitem__(1, 0.5), "seq 1: a logprob above 0"),
        (lambda t: t.sampling_logprobs[2].__setitem__(0, 0.5), "seq 2: a sampling logprob above 0"),
        (lambda t: t.logprobs[2].__setitem__(0, np.nan), "seq 2: non-finite logprobs"),
    ],
)
def test_the_checks_over_all_sequences_at_once_still_name_the_sequence_that_fails(breaks, message):
    """validate / check_trainable check every sequence in one pass; a
    trajectory that fails is gone through again to say which sequence."""
    t = with_sampling(make_traj())
    t.check_trainable(50, 16, newest_version=3)
    breaks(t)
    with pytest.raises(TrajectoryError, match=message):
        t.validate().check_trainable(50, 16, newest_version=3)
    t = make_traj()
    with pytest.raises(TrajectoryError, match="seq 1: 9 tokens, more than the model's 8 positions"):
        t.check_trainable(50, 8)
