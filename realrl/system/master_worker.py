"""MasterWorker: the training dataflow, one step per poll (DESIGN §2, §7).

Each step, over the request-reply stream to the model workers:

1. `fetch` on every data-parallel head (`__data{r}__`) until rank r holds its
   share of `train_batch_size` trajectories (oldest first; stale ones are
   dropped by the trainer, counted, and reported under `dropped_samples` at
   once so the GserverManager gives their staleness budget back);
2. `inference`: proximal logprobs (decoupled loss), reference logprobs
   (KL), values (PPO);
3. `train_step` on every rank; rank 0 publishes the new weights (version
   v+1) and sets `model_version/actor`.

Around the steps: stats to `stats.jsonl` + TensorBoard and a progress bar with
ETA (in this worker's log), greedy evaluation on the test split before
training, every `eval_every_n_steps`, and at the end, recovery checkpoints,
and finally `summary.json` and `experiment_status` COMPLETE.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp

from realrl.api.system_api import MasterWorkerConfig
from realrl.base import name_resolve, names
from realrl.base.stats import StatsLogger, histogram, summarize
from realrl.system.request_reply_stream import NameResolvingRequestClient
from realrl.system.worker_base import AsyncWorker, ExperimentStatus, PollResult, set_experiment_status

STARVED_WARNING_S = 30.0  # warn (again) after this long without new trajectories


class MasterWorker(AsyncWorker):
    config_cls = MasterWorkerConfig

    def _configure(self, config: MasterWorkerConfig) -> None:
        self.cfg = config
        n = config.n_model_workers
        routing: dict = {i: i for i in range(n)}
        routing.update({f"__data{i}__": i for i in range(n)})
        self.stream = NameResolvingRequestClient(self.experiment_name, self.trial_name, n, routing)
        self.step = 0
        self.version = 0
        self.consumed = 0
        self.dropped_stale = 0
        self.max_staleness_trained = 0
        self.eval_history: list[dict] = []
        self.started = time.monotonic()
        self.stats_logger: StatsLogger | None = None  # opened once we know whether we resume
        self.state_path = os.path.join(self.info.log_dir, "master_state.json")
        self.summary_path = os.path.join(self.info.log_dir, "summary.json")
        self._progress = None
        self._finished = False

    async def _setup_async(self) -> None:
        specs = await self.stream.call_async(list(range(self.cfg.n_model_workers)), "spec",
                                             [None] * self.cfg.n_model_workers, timeout=600)  # fmt: skip
        self.logger.info("model workers ready: %s", [(s["dp_rank"], s["version"]) for s in specs])
        if self.cfg.recover:
            await self._recover()
        self.stats_logger = StatsLogger(self.info.log_dir, resume_step=self.step)
        self._publish_counters()
        from tqdm import tqdm

        self._progress = tqdm(total=self.cfg.total_train_steps, initial=self.step, desc="train steps",
                              mininterval=1.0, dynamic_ncols=False, ncols=100)  # fmt: skip
        if self.cfg.evaluate and not self.eval_history:
            await self._evaluate()

    async def _teardown_async(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self.stats_logger is not None:
            self.stats_logger.close()
        self.stream.close()

    # ---- the step ------------------------------------------------------------------
    async def _poll_async(self) -> PollResult:
        if self._finished:
            return PollResult()
        if self.step >= self.cfg.total_train_steps:
            await self._finish()
            return PollResult()
        await self._train_step()
        return PollResult(batch_count=1)

    def _shares(self) -> list[int]:
        n, B = self.cfg.n_model_workers, self.cfg.train_batch_size
        return [B // n + (1 if r < B % n else 0) for r in range(n)]

    async def _fetch(self) -> dict:
        shares = self._shares()
        got = [0] * len(shares)
        collected: dict[str, list] = {k: [] for k in ("staleness", "version_start", "rewards", "correct", "seq_lens", "gen_lens")}
        dropped = 0
        min_version = self.version - self.cfg.max_head_offpolicyness
        waiting_since = last_warning = time.monotonic()
        while True:
            ranks = [r for r in range(len(shares)) if got[r] < shares[r]]
            if not ranks:
                break
            replies = await self.stream.call_async(
                [f"__data{r}__" for r in ranks], "fetch",
                [{"n": shares[r] - got[r], "min_version": min_version, "current_version": self.version} for r in ranks],
                timeout=self.cfg.rpc_timeout,
            )  # fmt: skip
            progress = False
            for r, reply in zip(ranks, replies):
                got[r] += reply["n_taken"]
                progress |= reply["n_taken"] > 0
                if reply["n_dropped"]:
                    dropped += reply["n_dropped"]
                    self.dropped_stale += reply["n_dropped"]
                    self._publish_counters()  # give the dropped rollouts' budget back now
                for k in collected:
                    collected[k].extend(reply[k])
            now = time.monotonic()
            if progress:
                waiting_since = now
            elif now - waiting_since > STARVED_WARNING_S and now - last_warning > STARVED_WARNING_S:
                last_warning = now
                await self._warn_starved(sum(got), sum(shares), now - waiting_since)
            if not progress:
                await asyncio.sleep(self.cfg.fetch_poll_interval)
        collected["dropped"] = dropped
        return collected

    async def _train_step(self) -> None:
        t0 = time.monotonic()
        all_ranks = list(range(self.cfg.n_model_workers))
        batch = await self._fetch()
        t_fetch = time.monotonic()
        if self.cfg.use_decoupled_loss or self.cfg.kl_ctl > 0 or self.cfg.algorithm == "ppo":
            await self.stream.call_async(all_ranks, "inference", [{"decoupled": self.cfg.use_decoupled_loss}] * len(all_ranks),
                                         timeout=self.cfg.rpc_timeout)  # fmt: skip
        t_inf = time.monotonic()
        results = await self.stream.call_async(all_ranks, "train_step", [{"version": self.version + 1}] * len(all_ranks),
                                               timeout=self.cfg.rpc_timeout)  # fmt: skip
        t_train = time.monotonic()
        self.version += 1
        self.step += 1
        self.consumed += self.cfg.train_batch_size
        self.max_staleness_trained = max([self.max_staleness_trained] + batch["staleness"])
        self._publish_counters()

        n_tokens = sum(batch["seq_lens"])
        stats: dict = {"version": self.version, "consumed": self.consumed, "dropped_stale": self.dropped_stale}
        for key in results[0]:
            values = [r[key] for r in results]
            stats[f"train/{key}"] = sum(values) / len(values)
        stats.update(summarize(batch["rewards"], "rollout/reward"))
        stats.update(summarize(batch["correct"], "rollout/accuracy"))
        stats.update(summarize([float(x) for x in batch["gen_lens"]], "rollout/gen_len"))
        stats.update(summarize([float(x) for x in batch["staleness"]], "staleness"))
        stats.update(summarize([float(x) for x in batch["version_start"]], "rollout/version_start"))
        stats["staleness/histogram"] = histogram(batch["staleness"])
        stats["time/fetch_s"] = t_fetch - t0
        stats["time/inference_s"] = t_inf - t_fetch
        stats["time/train_s"] = t_train - t_inf
        stats["time/step_s"] = t_train - t0
        stats["throughput/tokens_per_s"] = n_tokens / max(t_train - t0, 1e-9)
        stats["time/elapsed_s"] = time.monotonic() - self.started

        if self.cfg.eval_every_n_steps and self.step % self.cfg.eval_every_n_steps == 0 and self.step < self.cfg.total_train_steps:
            stats["eval/accuracy"] = (await self._evaluate())["accuracy"]
        if self.cfg.checkpoint_every_n_steps and self.step % self.cfg.checkpoint_every_n_steps == 0:
            await self._checkpoint()
        self.stats_logger.log(self.step, stats)
        acc = stats.get("rollout/accuracy/mean", stats.get("rollout/reward/mean", 0.0))
        self.logger.info(
            "step %d/%d v%d | acc %.3f reward %.3f | loss %.4f clip %.3f | staleness max %d | %.2fs (fetch %.2f, inf %.2f, train %.2f)",
            self.step, self.cfg.total_train_steps, self.version, acc, stats.get("rollout/reward/mean", 0.0),
            stats.get("train/actor_loss", 0.0), stats.get("train/clip_frac", 0.0), max(batch["staleness"], default=0),
            stats["time/step_s"], stats["time/fetch_s"], stats["time/inference_s"], stats["time/train_s"],
        )  # fmt: skip
        if self._progress is not None:
            self._progress.set_postfix(acc=f"{acc:.3f}", v=self.version)
            self._progress.update(1)

    async def _warn_starved(self, have: int, want: int, waited: float) -> None:
        """Says why a step is waiting, so a starved run is not silent."""
        try:
            rs = await self._manager("GET", "/rollout_stats")
        except Exception as e:  # the warning itself must not fail the step
            rs = None
            self.logger.debug("no rollout stats: %s", e)
        msg = f"step {self.step + 1}: no new trajectories for {waited:.0f}s (have {have}/{want})"
        if rs is not None:
            msg += f"; rollouts running {rs['running']}, accepted {rs['accepted']}, rejected by the agent {rs['rejected']}"
            if rs["rejected"] > 10 * max(rs["accepted"], 1):
                msg += (" -- the agent rejects almost every group (e.g. its success-rate filter): does the policy"
                        " solve none, or all, of the prompts?")  # fmt: skip
        self.logger.warning(msg)

    def _publish_counters(self) -> None:
        name_resolve.add(names.training_samples(self.experiment_name, self.trial_name), str(self.consumed),
                         replace=True, delete_on_exit=False)  # fmt: skip
        name_resolve.add(names.dropped_samples(self.experiment_name, self.trial_name), str(self.dropped_stale),
                         replace=True, delete_on_exit=False)  # fmt: skip

    # ---- evaluation, saving, recovery --------------------------------------------------------
    async def _evaluate(self) -> dict:
        n = self.cfg.n_model_workers
        parts = await self.stream.call_async(list(range(n)), "evaluate", [{}] * n, timeout=self.cfg.rpc_timeout)
        total = max(sum(p["n"] for p in parts), 1)
        result = {
            "step": self.step,
            "version": self.version,
            "accuracy": sum(p["n_correct"] for p in parts) / total,
            "reward_mean": sum(p["reward_sum"] for p in parts) / total,
            "n": sum(p["n"] for p in parts),
            "seconds": max(p["seconds"] for p in parts),
            "samples": [s for p in parts for s in p["samples"]],
        }
        self.eval_history.append({k: v for k, v in result.items() if k != "samples"})
        self.logger.info("eval at step %d: greedy accuracy %.3f on %d prompts (%.1fs); e.g. %s",
                         self.step, result["accuracy"], result["n"], result["seconds"], result["samples"][:2])  # fmt: skip
        self.stats_logger.log(self.step, {"eval/accuracy": result["accuracy"], "eval/n": result["n"]})
        return result

    async def _checkpoint(self) -> None:
        await self.stream.call_async(list(range(self.cfg.n_model_workers)), "checkpoint",
                                     [{"step": self.step}] * self.cfg.n_model_workers, timeout=self.cfg.rpc_timeout)  # fmt: skip
        state = {"step": self.step, "version": self.version, "consumed": self.consumed,
                 "dropped_stale": self.dropped_stale, "max_staleness_trained": self.max_staleness_trained,
                 "eval_history": self.eval_history}  # fmt: skip
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_path)
        self.logger.info("checkpoint at step %d", self.step)

    async def _recover(self) -> None:
        if not os.path.exists(self.state_path):
            self.logger.info("recover=auto: no checkpoint yet, starting fresh")
            return
        with open(self.state_path) as f:
            state = json.load(f)
        path = os.path.join(self.cfg.checkpoint_dir, f"step{state['step']}")
        n = self.cfg.n_model_workers
        replies = await self.stream.call_async(list(range(n)), "load", [{"path": path}] * n, timeout=self.cfg.rpc_timeout)
        self.step, self.version = state["step"], replies[0]["version"]
        self.consumed, self.dropped_stale = state["consumed"], state["dropped_stale"]
        self.max_staleness_trained = state["max_staleness_trained"]
        self.eval_history = state["eval_history"]
        self.logger.info("recovered at step %d (weight version %d) from %s", self.step, self.version, path)

    async def _manager(self, method: str, path: str) -> dict | None:
        try:
            url = name_resolve.get(names.gen_server_manager(self.experiment_name, self.trial_name))
        except name_resolve.NameEntryNotFoundError:
            return None
        async with aiohttp.ClientSession() as session:
            async with session.request(method, f"{url}{path}", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                resp.raise_for_status()
                return await resp.json()

    async def _finish(self) -> None:
        final_eval = await self._evaluate() if self.cfg.evaluate else {"accuracy": None}
        if self.cfg.save_final_model and self.cfg.final_model_dir:
            path = self.cfg.final_model_dir
            n = self.cfg.n_model_workers  # every rank: gathering FSDP shards is a collective
            await self.stream.call_async(list(range(n)), "save", [{"path": path}] * n, timeout=self.cfg.rpc_timeout)
            self.logger.info("saved the final model to %s", path)

        # Stop admitting rollouts, let in-flight ones finish, then account for every trajectory.
        produced = filtered = None
        try:
            if await self._manager("POST", "/stop_rollouts") is not None:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    rs = await self._manager("GET", "/rollout_stats")
                    if rs["running"] == 0:
                        produced, filtered = rs["accepted"] + rs["rejected"], rs["rejected"]
                        break
                    await asyncio.sleep(0.2)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.logger.warning("no final rollout accounting from the gserver manager: %s", e)
        all_ranks = list(range(self.cfg.n_model_workers))
        deadline = time.monotonic() + 15
        while True:  # wait until every pushed trajectory reached a puller
            buf = await self.stream.call_async(all_ranks, "stats", [None] * len(all_ranks), timeout=60)
            received = sum(s["received"] for s in buf)
            if produced is None or received >= produced - filtered or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        invalid = sum(s["invalid"] + s["wire_rejected"] for s in buf)
        specs = await self.stream.call_async(all_ranks, "spec", [{"checksum": True}] * len(all_ranks), timeout=600)
        checksums = {s["checksum"] for s in specs if s["checksum"] is not None}  # None: FSDP shards
        if len(checksums) > 1:
            self.logger.error("data-parallel ranks hold different weights: %s", [s["checksum"] for s in specs])
        summary = {
            "initial_eval_accuracy": self.eval_history[0]["accuracy"] if self.eval_history else None,
            "final_eval_accuracy": final_eval["accuracy"],
            "eval_history": self.eval_history,
            "steps": self.step,
            "final_version": self.version,
            "wall_time_s": time.monotonic() - self.started,
            "trajectories": {
                "produced": produced if produced is not None else received,
                "consumed": self.consumed,
                "dropped": self.dropped_stale + invalid + (filtered or 0),
                "dropped_stale": self.dropped_stale,
                "dropped_invalid": invalid,
                "filtered_by_agent": filtered or 0,
                "buffered": sum(s["buffered"] for s in buf),
            },
            "max_staleness_trained": self.max_staleness_trained,
            "max_head_offpolicyness": self.cfg.max_head_offpolicyness,
            "dp_weights_identical": len(checksums) <= 1,
            "stats_path": self.stats_logger.path,
        }
        tmp = self.summary_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, self.summary_path)
        self.logger.info("training complete: eval accuracy %s -> %s in %d steps, %.0fs; summary %s",
                         summary["initial_eval_accuracy"], summary["final_eval_accuracy"], self.step,
                         summary["wall_time_s"], self.summary_path)  # fmt: skip
        self._finished = True
        set_experiment_status(self.experiment_name, self.trial_name, ExperimentStatus.COMPLETE)
        self.request_exit("training complete")
