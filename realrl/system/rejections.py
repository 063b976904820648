"""The counted cap on rejected groups (docs/design.md §9, "Dynamic sampling").

Dynamic sampling (and the success-rate filter) make the agent reject groups
that carry no signal; they cost no staleness budget and a step waits for
informative ones. A task the filter rejects (almost) entirely would stall
that wait forever, so while a step waits the master compares the manager's
count of rejected groups, every `CHECK_INTERVAL_S`, with the count it read
during the previous step's training (its one reading per step, off the
step's critical path), and stops the trial with the reason past the cap.
"""

from __future__ import annotations

CHECK_INTERVAL_S = 2.0


class TooManyRejectedGroups(RuntimeError):
    """The agent rejected more groups than `rollout.max_rejected_batches` allows while one step waited."""


def check_rejections(step: int, before: int | None, now: int | None, cap: int, have: int, want: int) -> None:
    """Raises `TooManyRejectedGroups` when more than `cap` groups were rejected
    since `before` (counts that are None, from a manager that did not answer, pass)."""
    if before is None or now is None or now - before <= cap:
        return
    raise TooManyRejectedGroups(
        f"step {step}: the agent rejected {now - before} groups while this step waited (have {have}/{want} "
        f"trajectories; cap rollout.max_rejected_batches x ppo.train_batch_size = {cap}): the policy solves all "
        "or none of the prompts, so dynamic sampling (rollout.dynamic_sampling) or the success-rate filter "
        "leaves no group with a signal. Use harder or easier prompts, or turn the filter off"
    )
