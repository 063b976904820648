"""The trajectory schema (docs/design.md §5): what rollout workers push and trainers pull.

One `Trajectory` is one prompt's group of sampled answers (group_size
sequences; a multi-turn agent adds one sequence per turn and answer). Per
sequence: `input_ids` = prompt + completion (int32), `prompt_len`, behaviour
`logprobs` and weight `versions` per completion token, `version_start` /
`version_end` (weights at the first / last token), `reward` (what the trainer
optimises), `no_eos` (truncated), and optionally `scores`: the task's raw score
per sequence before reward shaping (1.0 = full credit; accuracy and the
success-rate filter read it), and optionally `loss_mask`: per completion token
whether the policy sampled it (a multi-turn sequence holds tool outputs and
user turns between its sampled spans), and optionally `sampling_logprobs` (per
completion token, its logprob under the filtered distribution it was drawn from,
when that differs from `logprobs`) and `sampling` (the `Sampling` parameters each
sequence was drawn with; the trainer recomputes logprobs at its temperature).
`Trajectory.from_results` builds one from
generation results. `to_wire()` packs the sequences into a few flat arrays for the
wire format (realrl.base.wire); `from_wire()` validates everything a peer sent
that the schema alone can judge, and `check_trainable(...)` what only the
receiver can: that every token id fits its model's vocabulary, every sequence
its model's positions, every weight version the trainer's history.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

# Rounding slack for "a logprob is <= 0" (servers compute in bf16 or fp16).
LOGPROB_SLACK = 1e-3


class TrajectoryError(ValueError):
    """A trajectory that breaks the schema (and what is wrong with it)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling parameters one sequence was generated with (SGLang's names)."""

    temperature: float  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature its logprobs are taken at: a greedy sequence's are plain `log_softmax(logits)`."""
        return self.temperature if self.temperature > 0 else 1.0

    def as_row(self) -> list[float]:
        return [float(self.temperature), float(self.top_p), float(self.top_k), float(self.min_p)]

    @classmethod
    def from_row(cls, row) -> Sampling:
        temperature, top_p, top_k, min_p = (float(x) for x in row)
        if not all(math.isfinite(x) for x in (temperature, top_p, top_k, min_p)) or temperature < 0:
            raise TrajectoryError(f"impossible sampling parameters {list(row)}")
        if top_k != int(top_k):
            raise TrajectoryError(f"sampling top_k must be an integer, got {top_k}")
        return cls(temperature, top_p, int(top_k), min_p)


@dataclasses.dataclass
class Trajectory:
    qid: str
    task: str
    birth_time: float
    input_ids: list[np.ndarray]
    prompt_len: list[int]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    version_start: list[int]
    version_end: list[int]
    reward: list[float]
    no_eos: list[bool]
    scores: list[float] = dataclasses.field(default_factory=list)  # empty, or one raw task score per sequence
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # empty (every completion token was sampled), or per sequence one bool per completion token:
    # True = sampled by the policy (trained), False = context inside the completion
    loss_mask: list[np.ndarray] = dataclasses.field(default_factory=list)
    # empty (the same as `logprobs`: nothing was filtered), or per sequence one float32 per completion token:
    # the logprob under the distribution the token was drawn from (after top-k/top-p/min-p, renormalised)
    sampling_logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    # empty (the run's sampling parameters), or per sequence the parameters it was drawn with
    sampling: list[Sampling] = dataclasses.field(default_factory=list)
    # Which admitted rollout this is, and which of its trajectories (docs/design.md §12): the key
    # the trainers acknowledge and drop second copies by. Set by the rollout worker; "" = none.
    rollout_id: str = ""
    index: int = 0
    # How many trajectories its rollout returned: a rollout is done once the trainers hold all of
    # them (docs/design.md §12), which a partly delivered one, at a checkpoint, is not.
    rollout_size: int = 1

    @property
    def key(self) -> tuple[str, int]:
        """(rollout_id, index): one trajectory of one admitted rollout, the same in every copy."""
        return self.rollout_id, self.index

    @classmethod
    def from_results(
        cls,
        prompt: Any,
        results: list,
        scores: list[float],
        rewards: list[float],
        metadata: dict[str, Any] | None = None,
    ) -> Trajectory:
        """One sequence per answer of each `GenerationResult` in `results`, in
        order: the result's `prompt_ids` (the whole context the answer was
        generated from) + the answer, with its logprobs and weight versions.
        `prompt` is the episode's PromptRecord (for qid and task); `scores` and
        `rewards` give one value per sequence. Sampling logprobs and
        parameters are kept where the results have them (all or none), and
        so is `metadata["answer_turn"]`: per sequence, which generation call
        of the episode its answer came from (`GenerationResult.turn`, 1 = the
        first; evaluation counts turns to a solution with it)."""
        input_ids, prompt_len, logprobs, versions, start, end, no_eos = [], [], [], [], [], [], []
        sampling_logprobs, sampling, answer_turn = [], [], []
        for result in results:
            for i in range(result.group_size):
                answer_turn.append(int(getattr(result, "turn", 0) or 0))
                input_ids.append(np.asarray(list(result.prompt_ids) + list(result.output_ids[i]), dtype=np.int32))
                prompt_len.append(len(result.prompt_ids))
                logprobs.append(np.asarray(result.output_logprobs[i], dtype=np.float32))
                filtered = getattr(result, "output_sampling_logprobs", None)
                sampling_logprobs.append(
                    logprobs[-1] if filtered is None else np.asarray(filtered[i], dtype=np.float32)
                )
                if getattr(result, "sampling", None) is not None:
                    sampling.append(result.sampling)
                versions.append(np.asarray(result.output_versions[i], dtype=np.int32))
                start.append(int(result.version_start[i]))
                end.append(int(result.version_end[i]))
                no_eos.append(bool(result.no_eos[i]))
        if sampling and len(sampling) != len(input_ids):
            raise TrajectoryError(f"trajectory {prompt.qid}: some results record their sampling parameters, some not")
        if all(a is b or np.array_equal(a, b) for a, b in zip(sampling_logprobs, logprobs)):
            sampling_logprobs = []  # nothing filtered: the same as the logprobs
        if len(scores) != len(input_ids) or len(rewards) != len(input_ids):
            raise TrajectoryError(
                f"trajectory {prompt.qid}: {len(input_ids)} sequences but {len(scores)} scores "
                f"and {len(rewards)} rewards"
            )
        metadata = dict(metadata or {})
        if answer_turn and all(k > 0 for k in answer_turn):
            metadata.setdefault("answer_turn", answer_turn)
        return cls(
            qid=prompt.qid,
            task=prompt.task,
            birth_time=time.time(),
            input_ids=input_ids,
            prompt_len=prompt_len,
            logprobs=logprobs,
            versions=versions,
            version_start=start,
            version_end=end,
            reward=[float(r) for r in rewards],
            no_eos=no_eos,
            scores=[float(s) for s in scores],
            metadata=metadata,
            sampling_logprobs=sampling_logprobs,
            sampling=sampling,
        ).validate()

    @property
    def group_size(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    @property
    def n_tokens(self) -> int:
        return sum(self.seq_lens)

    def behaviour_logprobs(self, i: int) -> np.ndarray:
        """Sequence i's logprobs under the distributions its tokens were drawn from."""
        return self.sampling_logprobs[i] if self.sampling_logprobs else self.logprobs[i]

    @property
    def min_version_start(self) -> int:
        """The staleness of a trajectory is that of its oldest sequence."""
        return min(self.version_start)

    def completion_ids(self, i: int) -> np.ndarray:
        return self.input_ids[i][self.prompt_len[i] :]

    def validate(self) -> Trajectory:
        n = len(self.input_ids)
        if not isinstance(self.qid, str) or not self.qid:
            raise TrajectoryError(f"qid must be a non-empty str, got {self.qid!r}")
        self.check_key()
        if n == 0:
            raise TrajectoryError(f"trajectory {self.qid} has no sequences")
        if self.scores and len(self.scores) != n:
            raise TrajectoryError(f"trajectory {self.qid}: scores has {len(self.scores)} entries for {n} sequences")
        if not all(math.isfinite(x) for x in self.scores):
            raise TrajectoryError(f"trajectory {self.qid}: non-finite score")
        for name in ("loss_mask", "sampling_logprobs", "sampling"):
            values = getattr(self, name)
            if values and len(values) != n:
                raise TrajectoryError(f"trajectory {self.qid}: {name} has {len(values)} entries for {n} sequences")
        if not all(isinstance(s, Sampling) for s in self.sampling):
            raise TrajectoryError(f"trajectory {self.qid}: sampling must hold Sampling records")
        chain = self.metadata.get("chain") if isinstance(self.metadata, dict) else None
        if chain is not None and (
            not isinstance(chain, (list, tuple))
            or len(chain) != n
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in chain)
        ):
            raise TrajectoryError(f"trajectory {self.qid}: metadata['chain'] must hold one int per sequence ({n})")
        per_seq = dict(
            prompt_len=self.prompt_len,
            logprobs=self.logprobs,
            versions=self.versions,
            version_start=self.version_start,
            version_end=self.version_end,
            reward=self.reward,
            no_eos=self.no_eos,
        )
        for field, values in per_seq.items():
            if len(values) != n:
                raise TrajectoryError(f"trajectory {self.qid}: {field} has {len(values)} entries for {n} sequences")
        for i in range(n):
            ids, plen = self.input_ids[i], self.prompt_len[i]
            if ids.ndim != 1 or ids.dtype != np.int32:
                raise TrajectoryError(
                    f"trajectory {self.qid} seq {i}: input_ids must be 1-D int32, got {ids.dtype}{ids.shape}"
                )
            if not 0 < plen <= len(ids):
                raise TrajectoryError(f"trajectory {self.qid} seq {i}: prompt_len {plen} outside 1..{len(ids)}")
            n_gen = len(ids) - plen
            per_token = [("logprobs", self.logprobs[i], np.float32), ("versions", self.versions[i], np.int32)]
            if self.loss_mask:
                per_token.append(("loss_mask", self.loss_mask[i], np.bool_))
            if self.sampling_logprobs:
                per_token.append(("sampling_logprobs", self.sampling_logprobs[i], np.float32))
            for name, arr, dtype in per_token:
                if arr.ndim != 1 or arr.dtype != dtype or len(arr) != n_gen:
                    raise TrajectoryError(
                        f"trajectory {self.qid} seq {i}: {name} must be 1-D {np.dtype(dtype).name} of length "
                        f"{n_gen} (completion tokens), got {arr.dtype}{arr.shape}"
                    )
            if self.version_start[i] > self.version_end[i]:
                raise TrajectoryError(f"trajectory {self.qid} seq {i}: version_start > version_end")
            if not math.isfinite(self.reward[i]):
                raise TrajectoryError(f"trajectory {self.qid} seq {i}: non-finite reward")
        # One pass over all sequences' values (a reduction per sequence cost more than the rest)
        for name in ("logprobs", "sampling_logprobs"):
            bad = _first_where(getattr(self, name), lambda flat: not np.isfinite(flat).all())
            if bad is not None:
                raise TrajectoryError(f"trajectory {self.qid} seq {bad}: non-finite {name}")
        return self

    def check_key(self) -> Trajectory:
        """The rollout key's types (a missing one is "" and 0: a trajectory of no admitted rollout)."""
        if not isinstance(self.rollout_id, str) or isinstance(self.index, bool) or not isinstance(self.index, int):
            raise TrajectoryError(f"trajectory {self.qid}: rollout_id must be a str and index an int")
        if self.index < 0:
            raise TrajectoryError(f"trajectory {self.qid}: index {self.index} < 0")
        size = self.rollout_size
        if isinstance(size, bool) or not isinstance(size, int) or not self.index < size:
            raise TrajectoryError(
                f"trajectory {self.qid}: rollout_size must be an int above its index {self.index}, got {size!r}"
            )
        return self

    def check_token_ids(self, vocab_size: int | None) -> Trajectory:
        """Raises TrajectoryError if a token id lies outside `0..vocab_size-1`
        (it would index past the model's embedding table); `None` checks
        nothing. Vectorised: a min and a max per sequence."""
        if vocab_size is None:
            return self
        for i, ids in enumerate(self.input_ids):
            if not ids.size:
                continue
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                where = int(np.argmax(ids == bad))
                part = "prompt" if where < self.prompt_len[i] else "completion"
                raise TrajectoryError(
                    f"trajectory {self.qid} seq {i}: token id {bad} at position {where} ({part}) "
                    f"outside the vocabulary 0..{vocab_size - 1}"
                )
        return self

    def check_trainable(
        self, vocab_size: int | None, max_positions: int | None = None, newest_version: int | None = None
    ) -> Trajectory:
        """Raises TrajectoryError unless a trainer can take this trajectory as
        it is: what `validate` checks (shapes, finite rewards and logprobs),
        plus what only the receiver knows: token ids within its vocabulary
        (`check_token_ids`), every sequence within its model's `max_positions`
        (a longer one cannot be trained and stalls a step or exhausts memory),
        weight versions of sampled tokens within 0..`newest_version` (the trainer's newest: a
        server never held a later one, and a later one would never go stale),
        and logprobs (behaviour and sampling ones) <= 0. None checks nothing of that bound.

        Checked over all sequences at once; only a trajectory that fails is
        gone through sequence by sequence, to say which one and why."""
        if self._trainable_at_once(vocab_size, max_positions, newest_version):
            return self
        self.check_token_ids(vocab_size)
        for i, ids in enumerate(self.input_ids):
            if max_positions is not None and len(ids) > max_positions:
                raise TrajectoryError(
                    f"trajectory {self.qid} seq {i}: {len(ids)} tokens, more than the model's {max_positions} positions"
                )
            bounds = [self.version_start[i], self.version_end[i]]
            # a context token inside a completion (loss_mask False) has version -1 (§5)
            sampled = self.versions[i][self.loss_mask[i]] if self.loss_mask else self.versions[i]
            if sampled.size:
                bounds += [int(sampled.min()), int(sampled.max())]
            if min(bounds) < 0 or (newest_version is not None and max(bounds) > newest_version):
                raise TrajectoryError(
                    f"trajectory {self.qid} seq {i}: weight versions {min(bounds)}..{max(bounds)} outside "
                    f"0..{'' if newest_version is None else newest_version} (the trainer's newest)"
                )
            for name, logprobs in (("logprob", self.logprobs), ("sampling logprob", self.sampling_logprobs)):
                if logprobs and logprobs[i].size and float(logprobs[i].max()) > LOGPROB_SLACK:
                    raise TrajectoryError(f"trajectory {self.qid} seq {i}: a {name} above 0")
        return self

    def _trainable_at_once(self, vocab_size: int | None, max_positions: int | None, newest: int | None) -> bool:
        """`check_trainable`'s conditions over the concatenated sequences (the
        same bounds: each holds for every sequence iff it holds for all)."""
        if not self.input_ids:  # nothing to check (validate refuses it)
            return True
        ids = np.concatenate(self.input_ids)
        if vocab_size is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            return False
        if max_positions is not None and max(map(len, self.input_ids)) > max_positions:
            return False
        versions = np.concatenate(self.versions)
        if self.loss_mask:  # a context token inside a completion has version -1 (§5)
            versions = versions[np.concatenate(self.loss_mask)]
        bounds = [min(self.version_start), max(self.version_end)]
        if versions.size:
            bounds += [int(versions.min()), int(versions.max())]
        if min(bounds) < 0 or (newest is not None and max(bounds) > newest):
            return False
        for logprobs in (self.logprobs, self.sampling_logprobs):
            if _first_where(logprobs, lambda flat: flat.size and float(flat.max()) > LOGPROB_SLACK) is not None:
                return False
        return True

    # ---- wire ------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """Flat arrays + lengths: few frames per trajectory, zero-copy on receipt."""
        return {
            "qid": self.qid,
            "task": self.task,
            "birth_time": float(self.birth_time),
            "seq_lens": np.asarray(self.seq_lens, dtype=np.int32),
            "prompt_len": np.asarray(self.prompt_len, dtype=np.int32),
            "input_ids": np.concatenate(self.input_ids).astype(np.int32, copy=False),
            "logprobs": _concat(self.logprobs, np.float32),
            "versions": _concat(self.versions, np.int32),
            "version_start": np.asarray(self.version_start, dtype=np.int32),
            "version_end": np.asarray(self.version_end, dtype=np.int32),
            "reward": np.asarray(self.reward, dtype=np.float32),
            "no_eos": np.asarray(self.no_eos, dtype=np.bool_),
            "scores": np.asarray(self.scores, dtype=np.float32),
            "metadata": self.metadata,
            "loss_mask": _concat(self.loss_mask, np.bool_),
            "sampling_logprobs": _concat(self.sampling_logprobs, np.float32),
            "sampling": np.asarray([s.as_row() for s in self.sampling], dtype=np.float64).reshape(-1),
            "rollout_id": self.rollout_id,
            "index": int(self.index),
            "rollout_size": int(self.rollout_size),
        }

    @staticmethod
    def from_wire(msg: Any) -> Trajectory:
        if not isinstance(msg, dict):
            raise TrajectoryError(f"trajectory message must be a dict, got {type(msg).__name__}")
        try:
            seq_lens = _array(msg, "seq_lens", np.int32)
            prompt_len = _array(msg, "prompt_len", np.int32)
            input_ids = _array(msg, "input_ids", np.int32)
            logprobs = _array(msg, "logprobs", np.float32)
            versions = _array(msg, "versions", np.int32)
            n = len(seq_lens)
            if np.any(seq_lens <= 0) or int(seq_lens.sum()) != len(input_ids):
                raise TrajectoryError("seq_lens do not add up to len(input_ids)")
            if len(prompt_len) != n or np.any(prompt_len <= 0) or np.any(prompt_len > seq_lens):
                raise TrajectoryError("prompt_len inconsistent with seq_lens")
            gen_lens = seq_lens - prompt_len
            if int(gen_lens.sum()) != len(logprobs) or len(versions) != len(logprobs):
                raise TrajectoryError("logprobs/versions lengths do not match completion lengths")
            seq_bounds, gen_bounds = [0, *np.cumsum(seq_lens).tolist()], [0, *np.cumsum(gen_lens).tolist()]
            loss_mask = []
            if len(msg.get("loss_mask", ())):
                loss_mask = _split(_array(msg, "loss_mask", np.bool_, len(logprobs)), gen_bounds)
            sampling_logprobs = []
            if len(msg.get("sampling_logprobs", ())):
                sampling_logprobs = _split(_array(msg, "sampling_logprobs", np.float32, len(logprobs)), gen_bounds)
            sampling = []
            if len(msg.get("sampling", ())):
                rows = _array(msg, "sampling", np.float64, 4 * n).reshape(n, 4)
                if (rows == rows[0]).all():  # a group drawn with one set of parameters (NaN never compares equal)
                    sampling = [Sampling.from_row(rows[0])] * n
                else:
                    sampling = [Sampling.from_row(row) for row in rows]
            meta = msg.get("metadata") or {}
            if not isinstance(meta, dict):
                raise TrajectoryError("metadata must be a dict")
            traj = Trajectory(
                qid=msg["qid"],
                task=str(msg["task"]),
                birth_time=float(msg["birth_time"]),
                input_ids=_split(input_ids, seq_bounds),
                prompt_len=prompt_len.tolist(),
                logprobs=_split(logprobs, gen_bounds),
                versions=_split(versions, gen_bounds),
                version_start=_array(msg, "version_start", np.int32, n).tolist(),
                version_end=_array(msg, "version_end", np.int32, n).tolist(),
                reward=_array(msg, "reward", np.float32, n).astype(float).tolist(),
                no_eos=_array(msg, "no_eos", np.bool_, n).tolist(),
                scores=_array(msg, "scores", np.float32, n).astype(float).tolist()
                if len(msg.get("scores", ()))
                else [],
                metadata=meta,
                loss_mask=loss_mask,
                sampling_logprobs=sampling_logprobs,
                sampling=sampling,
                rollout_id=msg.get("rollout_id", ""),
                index=msg.get("index", 0),
                rollout_size=msg.get("rollout_size", 1),
            )
        except KeyError as e:
            raise TrajectoryError(f"trajectory message lacks field {e}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, TrajectoryError):
                raise
            raise TrajectoryError(f"malformed trajectory message: {e}") from None
        return traj.validate()


def _split(flat: np.ndarray, bounds: list[int]) -> list[np.ndarray]:
    """Views of `flat` between consecutive `bounds` (np.split costs ~5x as much per piece)."""
    return [flat[start:end] for start, end in zip(bounds, bounds[1:])]


def _first_where(arrays: list[np.ndarray], fails) -> int | None:
    """The index of the first array for which `fails(array)`, None if none does;
    `fails` is asked once of all of them concatenated first (the common case)."""
    if not arrays or not fails(np.concatenate(arrays)):
        return None
    return next(i for i, array in enumerate(arrays) if fails(array))


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(a, dtype=dtype) for a in arrays])


def _array(msg: dict, field: str, dtype, length: int | None = None) -> np.ndarray:
    arr = msg[field]
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != dtype:
        got = f"{arr.dtype}{arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise TrajectoryError(f"field {field} must be a 1-D {np.dtype(dtype).name} array, got {got}")
    if length is not None and len(arr) != length:
        raise TrajectoryError(f"field {field} has {len(arr)} entries, expected {length}")
    return arr
