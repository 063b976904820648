"""MasterWorker: the training dataflow, one step per poll (docs/design.md §2, §7).

Each step, over the request-reply stream to the model workers:

1. the batch: `inventory` on every rank (each drops what is staler than η
   allows and lists its oldest trajectories) until the ranks hold
   `train_batch_size` trajectories together; the oldest B of all of them
   (`choose_batch`) are split across the ranks balanced by tokens
   (`plan_batch`), and `assemble` moves them there. With one rank, one
   `assemble` with `oldest: B` does both (its B oldest are the batch), sent
   right behind the previous step's `train_step` (not behind the last step,
   one a checkpoint follows, or before a step a test's gate holds), so the
   rank takes it as soon as that step is done. No rank has a quota of
   its own, so trajectories that arrive unevenly never stall a step. Stale
   drops are published under `dropped_samples` at once so the
   GserverManager gives their staleness budget back (what the pullers refuse
   was never admitted and returns none: docs/design.md §12);
2. `inference`: proximal logprobs (decoupled loss), reference logprobs
   (KL), values (PPO);
3. `train_step` on every rank; rank 0 publishes the new weights (version
   v+1) and sets `model_version/actor`.

Before the first step the master publishes `training_start` (the step and
the trajectory counts training starts from, fresh or recovered): the
GserverManager opens admission only then, with those counts, so a resumed
trial admits exactly what an uninterrupted one would.

Around the steps: stats to `stats.jsonl` + TensorBoard (+ Weights & Biases
offline with `wandb`), one line per step in this worker's log through the
`realrl.steps` logger (the launcher turns those into its console's progress
bar or periodic lines: realrl/base/console.py), greedy evaluation on the test
split before training, every `eval_every_n_steps`, and at the end, each
followed by the PNGs of `<log_dir>/plots/` (drawn by a child process while the
steps go on: realrl/base/plots.py's `LivePlots`), recovery
checkpoints, and finally `summary.json` and `experiment_status` COMPLETE.

Over 700 lines on purpose: it is the one place a step's dataflow, its
accounting (the ledger, §12) and the trial's end are read together; the
pure parts live beside it (checkpoints.py, ledger.py, rejections.py,
weights_check.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import TypeVar

import aiohttp

from realrl.api.agent_api import FULL_CREDIT
from realrl.api.manager_api import RejectedRolloutsReply, RolloutStats, SuccessReply
from realrl.api.system_api import MasterWorkerConfig
from realrl.base import faults, name_resolve, names, trial_secret
from realrl.base.console import STEP_LOGGER
from realrl.base.datapack import partition_balanced
from realrl.base.http_body import from_json, to_json
from realrl.base.logging import getLogger
from realrl.base.plots import LivePlots
from realrl.base.stats import StatsLogger, histogram, summarize
from realrl.impl import eval_metrics
from realrl.system import checkpoints
from realrl.system.client_routing import REPORT_INTERVAL_S
from realrl.system.ledger import LEDGER_FILE, Ledger, resume_info
from realrl.system.rejections import CHECK_INTERVAL_S, check_rejections
from realrl.system.request_reply_stream.request_client import NameResolvingRequestClient
from realrl.system.weights_check import dp_weights_identical
from realrl.system.worker_base import AsyncWorker, ExperimentStatus, PollResult, set_experiment_status

_T = TypeVar("_T")
STARVED_WARNING_S = 30.0  # warn (again) after this long without new trajectories


def choose_batch(inventories: list[list], batch_size: int) -> list[tuple[int, int, int]] | None:
    """The step's batch from what all ranks hold together: the `batch_size`
    oldest trajectories (by version_start, then birth time) as (rank, key,
    n_tokens), or None while the ranks hold fewer together."""
    items = [
        (version, birth, rank, key, n_tokens)
        for rank, inventory in enumerate(inventories)
        for key, version, birth, n_tokens in inventory
    ]
    if len(items) < batch_size:
        return None
    items.sort()
    return [(rank, key, n_tokens) for _, _, rank, key, n_tokens in items[:batch_size]]


def plan_batch(chosen: list[tuple[int, int, int]], n_ranks: int) -> list[int]:
    """The rank each chosen trajectory trains on: groups balanced by tokens
    (longest first into the lightest group), each group given to the rank
    that already holds most of its tokens, so as little as possible moves."""
    parts = partition_balanced([n_tokens for _, _, n_tokens in chosen], n_ranks)
    overlap = sorted(
        (
            (sum(chosen[i][2] for i in part if chosen[i][0] == rank), -p, rank)
            for p, part in enumerate(parts)
            for rank in range(n_ranks)
        ),
        reverse=True,
    )
    dest = [0] * len(chosen)
    used_parts, used_ranks = set(), set()
    for _, neg_p, rank in overlap:
        p = -neg_p
        if p in used_parts or rank in used_ranks:
            continue
        used_parts.add(p)
        used_ranks.add(rank)
        for i in parts[p]:
            dest[i] = rank
    return dest


class MasterWorker(AsyncWorker):
    config_cls = MasterWorkerConfig

    def _configure(self, config: MasterWorkerConfig) -> None:
        self.cfg = config
        n = config.n_model_workers
        routing: dict = {i: i for i in range(n)}
        routing.update({f"__data{i}__": i for i in range(n)})
        self.stream = NameResolvingRequestClient(
            self.experiment_name,
            self.trial_name,
            n,
            routing,
            host=self.bind_host,
            warn_after=config.rpc_warn_after,
            receipt_timeout=config.rpc_receipt_timeout,
            interrupt=self.raise_if_exiting,
        )
        self.step = 0
        self.version = 0
        self._inference_stage = config.needs_inference  # narrowed by the model workers' specs at set-up
        self.consumed = 0
        self.dropped_stale = 0
        # Refused at the pullers (schema; no rollout of ours; a second copy): counted apart from the
        # ledger, and never handed back as admission budget (they were never accepted: §12).
        self.dropped_invalid = 0
        self._invalid_seen = 0  # the pullers' own invalid count (since they started)
        self.filtered_at_checkpoint = 0  # episodes the agent had rejected by the checkpoint we resume from
        # The data ledger (docs/design.md §12): the rollouts done (all of their trajectories taken by
        # the pullers, or rejected by the agent), as per-epoch bitmaps; and at a resume, where each
        # rollout worker's cursor stood.
        self.ledger = Ledger()
        self.regenerated_before = 0  # prompts generated again after earlier resumes (from the checkpoint)
        self.resume: dict = {}
        self._last_checkpoint = time.monotonic()
        self.max_staleness_trained = 0
        self.env_totals: dict[str, float] = {}  # environment info numbers over the trained steps (this launch)
        self.eval_history: list[dict] = []
        self.started = time.monotonic()
        self.stats_logger: StatsLogger | None = None  # opened once we know whether we resume
        self.summary_path = os.path.join(self.info.log_dir, "summary.json")
        self.plots_dir = os.path.join(self.info.log_dir, "plots")
        self.plots: LivePlots | None = None  # once the stats logger is open
        self.step_logger = getLogger(STEP_LOGGER)  # one line per step: the log file; the launcher renders it
        # The manager's /rollout_stats, read once per step while the trainers train (off the step's
        # critical path): the previous step's reading is the baseline of this step's generation
        # figures and of its rejected groups. None: not read yet, or the manager did not answer.
        self._rollout_stats: RolloutStats | None = None
        self._wait_data_s = 0.0  # of the last _fetch: time the ranks held too few trajectories
        # One rank: the ids of the next step's `assemble`, sent right behind a train step (`_train_step`).
        self._next_batch: list[str] | None = None
        self._next_batch_since: float | None = None  # when the step it was sent behind ended (None: unknown)
        self._http: aiohttp.ClientSession | None = None  # to the manager, kept open (one connection, not one per call)
        self._manager_url: str | None = None  # resolved once; again after a connection error
        self._finished = False

    async def _setup_async(self) -> None:
        specs = await self.stream.call_async(
            list(range(self.cfg.n_model_workers)), "spec", [None] * self.cfg.n_model_workers, timeout=600
        )
        self.logger.info("model workers ready: %s", [(s["dp_rank"], s["version"]) for s in specs])
        # A step's `inference` request only when some rank's runs a model in it (with the proximal
        # logprobs from the train forward and no reference or critic, `train_step` prepares the
        # batch itself: one request and its two messages less per step).
        self._inference_stage = self.cfg.needs_inference and any(s.get("inference_computes", True) for s in specs)
        if self.cfg.recover:
            await self._recover()
        self._publish_dropped()  # (a resumed trial's count)
        # The baseline of the first step's generation figures, read before admission opens: the
        # rollouts that run during the first evaluation count in the first step's figures. A
        # manager not registered yet has admitted nothing (admission opens below): its counts
        # start from zero, and its servers' utilization from its start.
        baseline = await self._read_rollout_stats()
        self._rollout_stats = baseline if baseline is not None else _nothing_generated()
        self._publish_training_start()
        # Opened after admission opens: the stats logger's import of tensorboardX (~0.9 s of CPU)
        # and the first evaluation overlap the first batch's generation, which the first step
        # would otherwise wait for.
        self.stats_logger = StatsLogger(
            self.info.log_dir,
            resume_step=self.step,
            wandb={"project": self.experiment_name, "name": self.trial_name} if self.cfg.wandb else None,
        )
        self.plots = LivePlots(self.stats_logger.path, self.plots_dir, self.logger)
        if self.cfg.evaluate and not self.eval_history:
            await self._evaluate()

    async def _teardown_async(self) -> None:
        if self.plots is not None:
            await self.plots.close()
        if self.stats_logger is not None:
            self.stats_logger.close()
        if self._http is not None:
            await self._http.close()
        self.stream.close()

    def _progress_info(self) -> dict:
        """Step and stage for `realrl status` and the hang watchdog (which
        counts a new step or stage as progress); the stage is read off the
        coroutines the loop waits in, the RPCs from the request stream."""
        stages = {
            "_setup_async": "setup",
            "_recover": "recover",
            "_fetch": "fetch",
            "_evaluate": "evaluate",
            "_checkpoint": "checkpoint",
            "_finish": "finish",
            "_train_step": "step",
        }
        stage = next((stages[n] for n in reversed(self.awaiting()) if n in stages), "running")
        rpcs = self.stream.in_flight()
        if stage == "step" and rpcs:
            stage = rpcs[0][0]  # inference, train_step
        return {
            "step": self.step,
            "total_steps": self.cfg.total_train_steps,
            "stage": stage,
            "version": self.version,
            "waiting_on": [
                f"model_worker/{w} {name} {age:.0f}s{'' if ok else ' (unconfirmed)'}" for name, w, age, ok in rpcs
            ],
        }

    # ---- the step ------------------------------------------------------------------
    async def _poll_async(self) -> PollResult:
        if self._finished:
            return PollResult()
        if self.step >= self.cfg.total_train_steps:
            await self._finish()
            return PollResult()
        gate = f"master_worker.step_{self.step + 1}"
        if faults.is_armed(gate):  # a test holds the trial before this step (its `gate`)
            await asyncio.to_thread(faults.point, gate)
        await self._train_step()
        return PollResult(batch_count=1)

    async def _fetch(self) -> dict:
        n, B = self.cfg.n_model_workers, self.cfg.train_batch_size
        all_ranks = list(range(n))
        min_version = self.version - self.cfg.max_head_offpolicyness  # (n > 1; one rank: `_oldest_request`)
        started = waiting_since = last_warning = last_rejection_check = time.monotonic()
        # The count at the previous step's reading (this step's start, give or take a train step).
        rejected_before = None if self._rollout_stats is None else self._rollout_stats.rejected
        have = -1
        while True:
            asked = time.monotonic()
            if n == 1 and self._next_batch is not None:  # asked for behind the previous train step
                ids, self._next_batch, asked = self._next_batch, None, started
                replies = await self.stream.gather_async(ids, timeout=self.cfg.rpc_timeout)
            elif n == 1:
                # One rank: the batch is its B oldest (choose_batch's order, which its buffer
                # keeps), so one `assemble` drops the stale, looks and takes them: no inventory
                # round trip before it.
                replies = await self.stream.call_async(
                    all_ranks, "assemble", [self._oldest_request(self.version)], timeout=self.cfg.rpc_timeout
                )
            else:
                replies = await self.stream.call_async(
                    all_ranks, "inventory", [{"min_version": min_version, "limit": B}] * n, timeout=self.cfg.rpc_timeout
                )
            dropped_stale = sum(r["n_dropped"] for r in replies)
            self._count_invalid(sum(r["invalid"] for r in replies))
            if dropped_stale:
                self.dropped_stale += dropped_stale
                self._publish_dropped()  # give the dropped rollouts' budget back now
            if n == 1:
                chosen = None if "held" in replies[0] else replies
                held = replies[0].get("held", B)
            else:
                chosen = choose_batch([r["items"] for r in replies], B)
                held = sum(len(r["items"]) for r in replies)
            if chosen is not None:
                self._wait_data_s = asked - started  # (the request that found the batch not counted)
                break
            now = time.monotonic()
            if held != have:
                have, waiting_since = held, now
            elif now - waiting_since > STARVED_WARNING_S and now - last_warning > STARVED_WARNING_S:
                last_warning = now
                await self._warn_starved(held, B, now - waiting_since)
            if self.cfg.max_rejected_groups and now - last_rejection_check > CHECK_INTERVAL_S:
                last_rejection_check, cap = now, self.cfg.max_rejected_groups
                check_rejections(self.step + 1, rejected_before, await self._rejected_so_far(), cap, held, B)
            await asyncio.sleep(self.cfg.fetch_poll_interval)
        parts = chosen if n == 1 else await self._assemble(chosen)
        batch: dict = {
            k: [x for p in parts for x in p[k]]
            for k in (
                "staleness",
                "version_start",
                "rewards",
                "scores",
                "seq_lens",
                "gen_lens",
                "generate_in_flight",
                "qids",
            )
        }
        batch["rank_tokens"] = [p["n_tokens"] for p in parts]
        token_staleness: dict[str, int] = {}
        for p in parts:
            for k, n in p.get("token_staleness", {}).items():
                token_staleness[k] = token_staleness.get(k, 0) + n
        batch["token_staleness"] = dict(sorted(token_staleness.items(), key=lambda kv: int(kv[0])))
        batch["moved"] = sum(p["n_moved_out"] for p in parts)
        batch["env"] = {}  # environment info numbers, summed over the step's trajectories
        for p in parts:
            for k, v in p.get("env", {}).items():
                batch["env"][k] = batch["env"].get(k, 0.0) + v
        return batch

    def _oldest_request(self, version: int) -> dict:
        """One rank's `assemble` of the step that trains at `version`: its B oldest, none staler than η."""
        return {
            "oldest": self.cfg.train_batch_size,
            "min_version": version - self.cfg.max_head_offpolicyness,
            "current_version": version,
        }

    def _checkpoint_due(self, step: int, prefetched: bool) -> bool:
        """Whether a checkpoint follows `step`. The time-based one is not taken after a step behind
        which the next batch was taken already (those trajectories are neither buffered nor trained,
        so the checkpoint would lose them): it waits one step, for one taken after it."""
        every_n, every_s = self.cfg.checkpoint_every_n_steps, self.cfg.checkpoint_every_minutes * 60
        if every_n and step % every_n == 0:
            return True
        return bool(every_s) and not prefetched and time.monotonic() - self._last_checkpoint >= every_s

    async def _assemble(self, chosen: list[tuple[int, int, int]]) -> list[dict]:
        """Moves the chosen trajectories to the ranks that train them (`plan_batch`): the ranks' replies."""
        all_ranks = list(range(self.cfg.n_model_workers))
        dest = plan_batch(chosen, len(all_ranks))
        requests = []
        for rank in all_ranks:
            mine = [i for i, (owner, _, _) in enumerate(chosen) if owner == rank]
            recv_from = {
                str(r): sum(1 for i, (owner, _, _) in enumerate(chosen) if owner == r and dest[i] == rank)
                for r in all_ranks
                if r != rank
            }
            requests.append(
                {
                    "take": [chosen[i][1] for i in mine],
                    "send_to": [dest[i] for i in mine],
                    "recv_from": recv_from,
                    "current_version": self.version,
                }
            )
        return await self.stream.call_async(all_ranks, "assemble", requests, timeout=self.cfg.rpc_timeout)

    async def _train_step(self) -> None:
        if self._rollout_stats is None:  # no baseline (the manager did not answer at the previous step)
            self._rollout_stats = await self._read_rollout_stats()
        t0 = time.monotonic()
        if self._next_batch is not None and self._next_batch_since is not None:
            # The rank took this batch while the master logged the previous step: the step is
            # timed from that step's reply, logging included, so that none of its time is left out.
            t0 = self._next_batch_since
        all_ranks = list(range(self.cfg.n_model_workers))
        batch = await self._fetch()
        t_fetch = time.monotonic()
        if self._inference_stage:
            await self.stream.call_async(
                all_ranks,
                "inference",
                [{"decoupled": self.cfg.use_decoupled_loss}] * len(all_ranks),
                timeout=self.cfg.rpc_timeout,
            )
        t_inf = time.monotonic()
        last_step = self.step + 1 == self.cfg.total_train_steps
        train = {"version": self.version + 1, "last_step": last_step, "decoupled": self.cfg.use_decoupled_loss}
        train_ids = await self.stream.request_async(all_ranks, "train_step", [train] * len(all_ranks))
        # One rank: the next step's batch is asked for right behind this train step. The rank runs
        # its requests in order, so it takes the batch as soon as the step (and the publish of its
        # version) is done, from what it holds then, as the next step's `_fetch` would: while this
        # reply travels and the master logs this step instead of after. Not behind the last step,
        # nor one a checkpoint follows (the taken batch would be neither buffered nor trained in it),
        # nor before a step a test holds the trial at (its gate: the batch is taken after it).
        prefetched = (
            len(all_ranks) == 1
            and not last_step
            and not self._checkpoint_due(self.step + 1, prefetched=False)
            and not faults.is_armed(f"master_worker.step_{self.step + 2}")
        )
        if prefetched:
            request = self._oldest_request(self.version + 1)  # the next step's: at the version this one makes
            self._next_batch = await self.stream.request_async(all_ranks, "assemble", [request])
        # The manager's figures are read while the trainers train: an HTTP round trip between two
        # steps (or two in the fetch) would keep the trainers waiting.
        results, rollout_stats = await asyncio.gather(
            self.stream.gather_async(train_ids, timeout=self.cfg.rpc_timeout), self._read_rollout_stats()
        )
        t_train = time.monotonic()
        self._next_batch_since = t_train
        before, self._rollout_stats = self._rollout_stats, rollout_stats
        self.version += 1
        self.step += 1
        self.consumed += len(batch["staleness"])
        self.max_staleness_trained = max([self.max_staleness_trained] + batch["staleness"])

        n_tokens = sum(batch["seq_lens"])
        stats: dict = {
            "version": self.version,
            "consumed": self.consumed,
            "dropped_stale": self.dropped_stale,
            "dropped_invalid": self.dropped_invalid,
        }
        # The trainers reduce their stats over ranks: every rank reports the same.
        stats.update({f"train/{key}": value for key, value in results[0].items()})
        stats["batch/moved_between_ranks"] = batch["moved"]
        stats["batch/qids"] = batch["qids"]  # which prompts (`<query_id>@<epoch>`) this step trained on
        stats["batch/rank_tokens_max_over_mean"] = max(batch["rank_tokens"]) / max(
            n_tokens / len(batch["rank_tokens"]), 1e-9
        )
        stats.update(summarize(batch["rewards"], "rollout/reward"))
        # Accuracy: the fraction of trained answers with full credit (score >= 1).
        stats.update(summarize(batch["scores"], "rollout/score"))
        if batch["scores"]:
            stats["rollout/accuracy"] = sum(x >= FULL_CREDIT for x in batch["scores"]) / len(batch["scores"])
        stats.update(summarize([float(x) for x in batch["gen_lens"]], "rollout/gen_len"))
        stats.update({f"env/{k}": v for k, v in sorted(batch["env"].items())})
        for k, v in batch["env"].items():
            self.env_totals[k] = self.env_totals.get(k, 0.0) + v
        stats.update(summarize(batch["generate_in_flight"], "rollout/generate_in_flight"))
        stats.update(summarize([float(x) for x in batch["staleness"]], "staleness"))
        stats.update(summarize([float(x) for x in batch["version_start"]], "rollout/version_start"))
        stats["staleness/histogram"] = histogram(batch["staleness"])
        if batch["token_staleness"]:
            stats["staleness/token_histogram"] = batch["token_staleness"]  # generated tokens, per staleness
        stats["time/fetch_s"] = t_fetch - t0
        stats["time/wait_data_s"] = self._wait_data_s  # part of fetch_s
        if before is not None and rollout_stats is not None:  # dynamic sampling, success-rate filter
            stats["rollout/rejected_groups"] = rollout_stats.rejected - before.rejected
        stats["time/inference_s"] = t_inf - t_fetch
        stats["time/train_s"] = t_train - t_inf
        if isinstance(results[0].get("publish_seconds"), (int, float)):
            stats["time/publish_s"] = results[0]["publish_seconds"]  # part of train_s
        stats["time/step_s"] = t_train - t0
        stats["throughput/tokens_per_s"] = n_tokens / max(t_train - t0, 1e-9)
        stats.update(self._perf_stats(stats, n_tokens, before, rollout_stats))
        stats["time/elapsed_s"] = time.monotonic() - self.started

        if (
            self.cfg.eval_every_n_steps
            and self.step % self.cfg.eval_every_n_steps == 0
            and self.step < self.cfg.total_train_steps
        ):
            stats["eval/accuracy"] = (await self._evaluate())["accuracy"]
            self._next_batch_since = None  # (evaluation time is not a step's)
        if self._checkpoint_due(self.step, prefetched):
            await self._checkpoint()
        self.stats_logger.log(self.step, stats)
        acc = stats.get("rollout/accuracy", 0.0)  # trained answers with full credit
        # The format is read back by realrl/base/console.py (step N/T, acc, reward, staleness max).
        self.step_logger.info(
            "step %d/%d v%d | acc %.3f reward %.3f | loss %.4f clip %.3f | staleness max %d"
            " | %.2fs (fetch %.2f, inf %.2f, train %.2f)"
            " | idle trainer %s gen %s | tokens/s gen %s train %.0f",
            self.step,
            self.cfg.total_train_steps,
            self.version,
            acc,
            stats.get("rollout/reward/mean", 0.0),
            stats.get("train/actor_loss", 0.0),
            stats.get("train/clip_frac", 0.0),
            max(batch["staleness"], default=0),
            stats["time/step_s"],
            stats["time/fetch_s"],
            stats["time/inference_s"],
            stats["time/train_s"],
            _fmt(stats.get("perf/trainer_idle_ratio"), ".2f"),
            _fmt(stats.get("perf/gen_idle_ratio"), ".2f"),
            _fmt(stats.get("perf/gen_tokens_per_s"), ".0f"),
            stats["perf/train_tokens_per_s"],
        )

    def _perf_stats(self, stats: dict, n_tokens: int, before: RolloutStats | None, now: RolloutStats | None) -> dict:
        """Idle ratios and throughput of this step (docs/observability.md):
        the trainers' from this step's timings, the generation servers' from
        the manager's cumulative figures since the previous step's reading."""
        step_s = max(stats["time/step_s"], 1e-9)
        perf = {
            "perf/trainer_idle_ratio": min(max(stats["time/wait_data_s"] / step_s, 0.0), 1.0),
            "perf/train_tokens_per_s": n_tokens / step_s,
        }
        if before is not None and now is not None:
            server_s = float(now.gen_server_s) - float(before.gen_server_s)
            clock_s = float(now.gen_clock_s) - float(before.gen_clock_s)
            if server_s > 0 and clock_s > 0:
                idle = float(now.gen_idle_s) - float(before.gen_idle_s)
                perf["perf/gen_idle_ratio"] = min(max(idle / server_s, 0.0), 1.0)
                perf["perf/gen_tokens_per_s"] = (float(now.gen_tokens) - float(before.gen_tokens)) / clock_s
        return perf

    async def _read_rollout_stats(self) -> RolloutStats | None:
        """The manager's /rollout_stats (cumulative generation figures, rejected groups); None
        when it does not answer (the step's figures that need it are then left out)."""
        try:
            return await self._manager("GET", "/rollout_stats", RolloutStats)
        except Exception as e:  # figures only: never fail the step
            self.logger.debug("no rollout stats from the gserver manager: %s: %s", type(e).__name__, e)
            return None

    async def _rejected_so_far(self) -> int | None:
        """The groups the agents rejected so far (the manager's count); None when it does not answer."""
        try:
            rs = await self._manager("GET", "/rollout_stats", RolloutStats)
        except Exception:  # a count only (figures, the cap): never fail the step for it
            return None
        return None if rs is None else int(rs.rejected)

    async def _warn_starved(self, have: int, want: int, waited: float) -> None:
        """Says why a step is waiting, so a starved run is not silent."""
        try:
            rs = await self._manager("GET", "/rollout_stats", RolloutStats)
        except Exception as e:  # the warning itself must not fail the step
            rs = None
            self.logger.debug("no rollout stats: %s", e)
        msg = f"step {self.step + 1}: no new trajectories for {waited:.0f}s (have {have}/{want})"
        if rs is not None:
            msg += f"; rollouts running {rs.running}, accepted {rs.accepted}, rejected by the agent {rs.rejected}"
            if rs.rejected > 10 * max(rs.accepted, 1):
                msg += (
                    " -- the agent rejects almost every group (e.g. its success-rate filter): does the policy"
                    " solve none, or all, of the prompts?"
                )
        self.logger.warning(msg)

    def _count_invalid(self, pullers_total: int) -> int:
        """Adds the trajectories the pullers rejected since we last looked."""
        new = pullers_total - self._invalid_seen
        self._invalid_seen = pullers_total
        self.dropped_invalid += new
        return new

    @property
    def dropped(self) -> int:
        """Accepted trajectories the trainers dropped (stale): their budget goes back (§7)."""
        return self.dropped_stale

    def _publish_dropped(self) -> None:
        """`dropped_samples`, written when it changes (the manager reads it every poll), not every step."""
        name_resolve.add(
            names.dropped_samples(self.experiment_name, self.trial_name),
            str(self.dropped),
            replace=True,
            delete_on_exit=False,
        )

    def _publish_training_start(self) -> None:
        """Opens the manager's admission with the counts training starts from."""
        start = {
            "step": self.step,
            "version": self.version,
            "consumed": self.consumed,
            "dropped": self.dropped,
            "filtered": self.filtered_at_checkpoint,
            **self.resume,
        }
        name_resolve.add(
            names.training_start(self.experiment_name, self.trial_name),
            json.dumps(start),
            replace=True,
            delete_on_exit=False,
        )

    # ---- evaluation, saving, recovery --------------------------------------------------------
    async def _evaluate(self, final: bool = False) -> dict:
        n = self.cfg.n_model_workers
        parts = await self.stream.call_async(list(range(n)), "evaluate", [{}] * n, timeout=self.cfg.rpc_timeout)
        summary = eval_metrics.merge(parts)
        scores = eval_metrics.metrics(summary)  # accuracy, score_mean, turns_mean, solved_within_<k>
        result = {
            "step": self.step,
            "version": self.version,
            **scores,
            "n": summary["n"],
            "seconds": max(p["seconds"] for p in parts),
            "samples": [s for p in parts for s in p["samples"]],
        }
        self.eval_history.append({k: v for k, v in result.items() if k != "samples"})
        self.logger.info(
            "eval at step %d: greedy accuracy %.3f on %d prompts (%.1fs); e.g. %s",
            self.step,
            result["accuracy"],
            result["n"],
            result["seconds"],
            result["samples"][:2],
        )
        self.stats_logger.log(
            self.step,
            {
                "eval/accuracy": result["accuracy"],
                "eval/score": result["score_mean"],
                "eval/n": result["n"],
                "eval/turns_mean": result["turns_mean"],
                **{f"eval/{k}": v for k, v in scores.items() if k.startswith("solved_within_")},
                "time/elapsed_s": time.monotonic() - self.started,
            },
        )
        self.plots.request(final=final)  # drawn beside the steps, not during this pause (a minute or more apart)
        return result

    async def _checkpoint(self) -> None:
        """A recovery checkpoint (realrl/system/checkpoints.py), in this order:
        the trainers write models, buffered trajectories and the keys their
        pullers took, and name the rollouts complete there (all of their
        trajectories taken), then the rollout cursors are read, then the
        manager's rejected rollouts. A cursor read after the buffers were
        saved covers every prompt they hold; whatever was issued before it
        and is not in the ledger (complete or rejected: `ledger.npz`; a
        partly delivered rollout is not) is generated again by a resumed
        trial (exactly once, docs/design.md §12)."""
        n = self.cfg.n_model_workers
        temp = checkpoints.new_temp_dir(self.cfg.checkpoint_dir, self.step)
        parts = await self.stream.call_async(
            list(range(n)), "checkpoint", [{"step": self.step, "dir": temp}] * n, timeout=self.cfg.rpc_timeout
        )
        for p in parts:
            self.ledger.update(Ledger.from_wire(p["complete"]))
        cursors = await asyncio.to_thread(self._read_rollout_cursors)
        filtered = self.filtered_at_checkpoint
        try:  # the agent-filtered count keeps the whole-trial accounting after a resume
            rs = await self._manager("GET", "/rollout_stats", RolloutStats)
            rq = await self._manager("GET", "/rejected_rollouts", RejectedRolloutsReply)
            if rs is not None and rq is not None:
                filtered = rs.rejected
                self.ledger.update(Ledger.from_wire(rq.rejected))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self.logger.warning("checkpoint without the manager's rejected episodes: %s", e)
        buffered = sum(p["buffered"] for p in parts)
        await asyncio.to_thread(self.ledger.save, os.path.join(temp, LEDGER_FILE))
        state = {
            "step": self.step,
            "version": self.version,
            "consumed": self.consumed,
            "dropped_stale": self.dropped_stale,
            "dropped_invalid": self.dropped_invalid,
            "filtered": filtered,
            "max_staleness_trained": self.max_staleness_trained,
            "eval_history": self.eval_history,
            "buffered": buffered,
            "ledger": LEDGER_FILE,
            "rollout_cursors": cursors,
            "regenerated": self.regenerated_before + sum(c.get("regenerated", 0) for c in cursors.values()),
            "elapsed_s": time.monotonic() - self.started,
        }
        with open(os.path.join(temp, "master_state.json"), "w") as f:
            json.dump(state, f)
        path = checkpoints.commit(temp, self.cfg.checkpoint_dir, self.step)
        self._last_checkpoint = time.monotonic()
        self.logger.info(
            "checkpoint at step %d: %s (%d trajectories buffered, %d rollouts done in the ledger)",
            self.step,
            path,
            buffered,
            self.ledger.count(),
        )

    def _read_rollout_cursors(self) -> dict[str, dict]:
        cursors = {}
        for i in range(self.cfg.n_rollout_workers):
            try:
                value = name_resolve.get(names.rollout_cursor(self.experiment_name, self.trial_name, i))
            except name_resolve.NameEntryNotFoundError:
                continue
            cursors[str(i)] = json.loads(value)
        return cursors

    async def _recover(self) -> None:
        path = await asyncio.to_thread(checkpoints.newest_valid, self.cfg.checkpoint_dir)
        if path is None:
            self.logger.info("recover=auto: no usable checkpoint, starting fresh")
            return
        with open(os.path.join(path, "master_state.json")) as f:
            state = json.load(f)
        n = self.cfg.n_model_workers
        replies = await self.stream.call_async(
            list(range(n)), "load", [{"path": path}] * n, timeout=self.cfg.rpc_timeout
        )
        self.step, self.version = state["step"], replies[0]["version"]
        self.consumed, self.dropped_stale = state["consumed"], state["dropped_stale"]
        self.dropped_invalid, self.filtered_at_checkpoint = state.get("dropped_invalid", 0), state.get("filtered", 0)
        self.max_staleness_trained = state["max_staleness_trained"]
        self.eval_history = state["eval_history"]
        self.started = time.monotonic() - float(state.get("elapsed_s", 0.0))  # time/elapsed_s goes on from here
        self.regenerated_before = int(state.get("regenerated", 0))
        restored = sum(r["restored"] for r in replies)
        self.ledger, self.resume = await asyncio.to_thread(resume_info, path, state, restored, self.cfg.checkpoint_dir)
        self.logger.info(
            "recovered at step %d (weight version %d) from %s: %d buffered trajectories restored",
            self.step,
            self.version,
            path,
            restored,
        )

    async def _manager(self, method: str, path: str, reply_type: type[_T]) -> _T | None:
        """A call to the gserver manager (no request body), its reply read as
        `reply_type` (a `manager_api` class); None when no manager is registered."""
        if self._manager_url is None:
            try:
                self._manager_url = name_resolve.get(names.gen_server_manager(self.experiment_name, self.trial_name))
            except name_resolve.NameEntryNotFoundError:
                return None
        if self._http is None:
            self._http = aiohttp.ClientSession(headers=trial_secret.http_headers())
        try:
            async with self._http.request(
                method, f"{self._manager_url}{path}", timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                resp.raise_for_status()
                return from_json(reply_type, await resp.json())
        except aiohttp.ClientConnectionError:
            self._manager_url = None  # a manager at a new address registers it anew
            raise

    async def _finish(self) -> None:
        final_eval = await self._evaluate(final=True) if self.cfg.evaluate else {"accuracy": None}
        if not self.cfg.evaluate:  # (else the final evaluation asked for them)
            self.plots.request(final=True)  # drawn while the model is saved and the trajectories counted
        if self.cfg.save_final_model and self.cfg.final_model_dir:
            path = self.cfg.final_model_dir
            n = self.cfg.n_model_workers  # every rank: gathering FSDP shards is a collective
            await self.stream.call_async(list(range(n)), "save", [{"path": path}] * n, timeout=self.cfg.rpc_timeout)
            self.logger.info("saved the final model to %s", path)

        # Stop admitting rollouts, let in-flight ones finish, then account for every trajectory.
        ledger = None  # the manager's whole-trial counts: accepted trajectories, rejected episodes
        try:
            if await self._manager("POST", "/stop_rollouts", SuccessReply) is not None:
                deadline, settled_by = time.monotonic() + 120, None
                while time.monotonic() < deadline:
                    rs = await self._manager("GET", "/rollout_stats", RolloutStats)
                    if rs.running == 0:
                        ledger = rs
                        # The servers' in-flight counts come from the rollout workers' load reports
                        # (every REPORT_INTERVAL_S), which follow the last answers: a few more readings.
                        if not any(rs.server_in_flight.values()) or time.monotonic() > (settled_by or deadline):
                            break
                        settled_by = settled_by or time.monotonic() + 8 * REPORT_INTERVAL_S
                    await asyncio.sleep(0.2)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.logger.warning("no final rollout accounting from the gserver manager: %s", e)
        all_ranks = list(range(self.cfg.n_model_workers))
        deadline = time.monotonic() + 15
        while True:  # wait until every accepted trajectory reached a puller
            buf = await self.stream.call_async(all_ranks, "stats", [None] * len(all_ranks), timeout=60)
            self._count_invalid(sum(s["invalid"] for s in buf))
            arrived = self.consumed + self.dropped + sum(s["buffered"] for s in buf)
            if ledger is None or arrived >= ledger.accepted or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        specs = await self.stream.call_async(all_ranks, "spec", [{"checksum": True}] * len(all_ranks), timeout=600)
        weights_identical = dp_weights_identical(specs)
        self.logger.debug("plots: %s", await self.plots.wait())  # in plots_dir before the summary says so
        if not weights_identical:
            self.logger.error("data-parallel ranks hold different weights: %s", specs)
        summary = {
            "initial_eval_accuracy": self.eval_history[0]["accuracy"] if self.eval_history else None,
            "final_eval_accuracy": final_eval["accuracy"],
            "eval_history": self.eval_history,
            "steps": self.step,
            "final_version": self.version,
            "wall_time_s": time.monotonic() - self.started,
            # produced = consumed + dropped + buffered, counted independently:
            # produced by the manager, the rest by the master and the trainers.
            "trajectories": {
                "produced": None if ledger is None else ledger.accepted + ledger.rejected,
                "consumed": self.consumed,
                "dropped": self.dropped + (ledger.rejected if ledger is not None else 0),
                "dropped_stale": self.dropped_stale,
                "dropped_invalid": self.dropped_invalid,
                "filtered_by_agent": None if ledger is None else ledger.rejected,
                "buffered": sum(s["buffered"] for s in buf),
                # Refused by the pullers, counted apart from the ledger (never accepted, no budget back):
                "rejected_frames": sum(s["wire_rejected"] for s in buf),
                "seal_refused_frames": sum(s["seal_refused"] for s in buf),  # not from this trial (§14)
                "foreign": sum(s["foreign"] for s in buf),  # no rollout of ours
                "duplicates_dropped": sum(s["duplicates_dropped"] for s in buf),  # a second copy of one taken
                **({} if ledger is not None else {"note": "the gserver manager did not report: produced unknown"}),
            },
            "rollouts": to_json(ledger),  # the manager's counts (admitted: episodes admitted by this run's manager)
            "max_staleness_trained": self.max_staleness_trained,
            # a resumed trial: prompts in flight (or not yet offered) at the checkpoint, generated again once
            "regenerated_after_resume": self.regenerated_before
            + sum(c.get("regenerated", 0) for c in (await asyncio.to_thread(self._read_rollout_cursors)).values()),
            "max_head_offpolicyness": self.cfg.max_head_offpolicyness,
            "dp_weights_identical": weights_identical,
            "stats_path": self.stats_logger.path,
            # A judge model's calls and failures (failed calls scored 0), over the trained trajectories.
            **(
                {"judge": {k: int(self.env_totals.get(f"judge_{k}", 0)) for k in ("calls", "failures")}}
                if "judge_calls" in self.env_totals
                else {}
            ),
            "plots_dir": self.plots_dir,
        }
        tmp = self.summary_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, self.summary_path)
        self.logger.info(
            "training complete: eval accuracy %s -> %s in %d steps, %.0fs; summary %s, plots in %s",
            summary["initial_eval_accuracy"],
            summary["final_eval_accuracy"],
            self.step,
            summary["wall_time_s"],
            self.summary_path,
            self.plots_dir,
        )
        self._finished = True
        set_experiment_status(self.experiment_name, self.trial_name, ExperimentStatus.COMPLETE)
        self.request_exit("training complete")


def _nothing_generated() -> RolloutStats:
    """The manager's figures before it admitted anything: every count and
    cumulative figure zero."""
    return RolloutStats(
        running=0,
        accepted=0,
        rejected=0,
        dropped=0,
        admitted=0,
        version=0,
        trainer_version=0,
        n_tokens=0,
        started=False,
        stopped=False,
        loaded_version=0,
        n_servers=0,
        server_in_flight={},
        server_events={},
        bad_requests=0,
        unauthorized=0,
        gen_idle_s=0.0,
        gen_server_s=0.0,
        gen_tokens=0,
        gen_clock_s=0.0,
    )


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
