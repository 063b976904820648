"""The RolloutWorker: prompts in, trajectories out (docs/design.md §2, §5-§7).

Each rollout worker owns a shard of the prompt data set
(`records[worker_index::worker_count]`) and keeps up to
`max_concurrent_rollouts` episodes in flight:

1. the next prompts (epochs in a per-epoch shuffle seeded by (seed,
   worker_index, epoch); the episode qid is `"<query_id>@<epoch>"`, unique
   across epochs) are offered to the GserverManager as one list, up to
   ALLOCATE_BATCH (`/allocate_rollout`, a long poll: the manager holds the
   call up to ALLOCATE_WAIT_S for admission to open, and admits as many as
   fit, in order); the admitted episodes start together (so their first
   generation rounds go out as one request), the others are offered again
   first; a refusal with nothing admitted at once (rollouts stopped) backs
   off briefly (allocate and finish carry the episode's `rollout_id`, so the
   manager ignores a retried call);
2. an admitted episode runs `agent.run_episode(record, env, partial_rollout)`
   against a fresh environment: every `self.generate(...)` of the agent
   becomes a `GenerationRequest` served by the `PartialRolloutManager`
   (several may be in flight at once), each `/generate` with the episode's
   priority (`EPISODE_PRIORITY`): its start order over `episodes_per_priority`
   (one trainer batch's share), so a server admits the episodes started first
   first and the trainer's first batch is not done only with the last; an agent over the OpenAI chat API
   (`uses_chat_endpoint`: agent functions, external agents) reaches it through
   the worker's OpenAI-compatible endpoint, which the worker serves for its
   whole life on its node's address and registers as `chat_endpoint/<index>`;
3. every returned trajectory, stamped with the rollout's id and its index
   (docs/design.md §12), is pushed (`traj.to_wire()`) to this worker's
   trainer puller and acknowledged by it, through an `AckedPusher` (a thread
   of its own, so that back-pressure never blocks the event loop, and many
   trajectories in flight at once, not a round trip each; the episodes that
   end together submit theirs as one call: one frame, one acknowledgement
   message); then `/finish_rollout` with the number of trajectories the
   trainer holds (0: the agent rejected the prompt, which uses no staleness
   budget), one call for the episodes that end together.

A rollout id is `<worker>:<epoch>:<row>`, the same when the rollout is
generated again. A resumed trial's worker, and one the launcher restarted,
first generate again what they issued before their cursor and the ledger
does not hold as done (`_read_training_start`).

An episode that fails (e.g. generation failed after the PartialRolloutManager's
retries) fails the worker: the exception propagates out of `_poll_async`, the
worker base records the traceback and the launcher stops the trial.

For inspection, every `sample_log_every`-th trajectory is appended as one JSON
line to `<log_dir>/samples/rollout-<index>.jsonl` (qid, versions, prompt,
decoded answers, rewards), and counters are logged every ~10 s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import re
import time

import numpy as np

from realrl.api.agent_api import PromptRecord, make_agent
from realrl.api.env_api import make_env
from realrl.api.manager_api import ResetRolloutWorkerReply, ResetRolloutWorkerRequest
from realrl.api.system_api import RolloutWorkerConfig
from realrl.api.trajectory import Trajectory
from realrl.base import faults, name_resolve, names, network, trial_secret
from realrl.base.http_body import from_json, to_json
from realrl.base.tick_batch import TickBatcher
from realrl.impl.generation import make_client
from realrl.impl.generation.eos import eos_token_ids_in_dir
from realrl.impl.openai_compat.endpoint import shared_endpoint
from realrl.system.acked_delivery import AckedPusher
from realrl.system.client_routing import ClientRouting, ManagerRouting
from realrl.system.ledger import Ledger, rollout_id, undone
from realrl.system.manager_client import GserverManagerClient
from realrl.system.partial_rollout import EPISODE_PRIORITY, PartialRolloutManager
from realrl.system.push_pull_stream import NameResolvingZmqPusher
from realrl.system.stream_dataset import HELD_QUERY
from realrl.system.worker_base import RESTARTS_ENV, AsyncWorker, PollResult

STATS_INTERVAL_S = 10.0
# The published data cursor runs ahead of the real one by about CURSOR_PERIOD_S of prompts at the
# rate they are issued, at least CURSOR_AHEAD, at most CURSOR_AHEAD_MAX: one name-service write
# every ~2 s however fast the prompts go (a resumed trial generates at most that many prompts early).
CURSOR_AHEAD = 32
CURSOR_AHEAD_MAX = 4096
CURSOR_PERIOD_S = 2.0
PUSH_POLL_S = 1.0  # a blocked delivery re-checks for exit this often
# An allocation the manager refuses waits there up to this long for admission
# to open (a new weight version, a finished rollout): the next rollout starts
# as soon as it may, with no polling. Short, so the loop still reaps episodes.
ALLOCATE_WAIT_S = 1.0
ALLOCATE_BATCH = 64  # prompts offered in one allocate_rollout call at most
REFUSAL_BACKOFF_S = (0.05, 0.5)  # first and largest wait after an allocation refused without waiting
MANAGER_CALL_TIMEOUT_S = 30.0
# How long set-up waits for the manager's URL and the trainer's puller (both
# appear only once servers / model workers have loaded their models).
SETUP_TIMEOUT_S = 900.0


class RolloutWorker(AsyncWorker):
    config_cls = RolloutWorkerConfig
    # Thousands of episodes in flight hold millions of references (token and logprob lists), and
    # Python's default thresholds ran a full collection over all of them every ~10 s, stalling the
    # event loop, and every generation call waiting in it, for 0.1-0.5 s (8k episodes per worker,
    # benchmarks/control_plane.py). Young collections stay frequent; full ones become rare. What an
    # episode leaves behind is freed by reference counting: the worker's memory stayed flat.
    collector_thresholds = (50_000, 50, 1000)

    # ---- set-up (before the event loop) ------------------------------------------
    def _configure(self, config: RolloutWorkerConfig) -> None:
        # Built-in agents / environments register on import; user plugins were
        # already loaded by the worker base from info.plugins.
        import realrl.impl.agents  # noqa: F401
        import realrl.impl.environments  # noqa: F401

        self.cfg = config
        if config.max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {config.max_concurrent_rollouts}")
        self.prompts, self.n_skipped_prompts = self._load_prompts(config)
        settings = dataclasses.replace(config.agent_settings, tokenizer=self.tokenizer)
        self.agent = make_agent(config.agent.type, settings, **config.agent.args)

        self.manager_url = self._wait_for_key(names.gen_server_manager(self.experiment_name, self.trial_name))
        self.pusher = NameResolvingZmqPusher(
            self.experiment_name,
            self.trial_name,
            self.info.worker_index,
            self.info.worker_count,
            config.n_pullers,
            timeout=SETUP_TIMEOUT_S,
        )
        self._delivery = AckedPusher(self.pusher, poll_s=PUSH_POLL_S, should_stop=lambda: self.exiting, log=self.logger)

        self._sample_file = None
        if self.info.log_dir and config.sample_log_every > 0:
            os.makedirs(os.path.join(self.info.log_dir, "samples"), exist_ok=True)
            path = os.path.join(self.info.log_dir, "samples", f"rollout-{self.info.worker_index}.jsonl")
            self._sample_file = open(path, "a", encoding="utf-8")

        # Prompt order: position in this epoch's permutation of the shard.
        self.epoch = 0
        self._order = self._epoch_order(0)
        self._position = 0
        self._pending: list[PromptRecord] = []  # prompts offered and not admitted yet, offered again first
        self._redo: collections.deque[PromptRecord] = collections.deque()  # a resumed trial's unfinished prompts
        self._ledger = Ledger()  # what is done (docs/design.md §12), as training_start and the manager say
        self.n_regenerated = 0
        self._cursor_published = 0
        self._cursor_ahead = CURSOR_AHEAD  # (adapted to the rate of prompts, see CURSOR_PERIOD_S)
        self._cursor_time: float | None = None  # monotonic time of the last write ahead
        self._training_started = False
        self.restarts = int(os.environ.get(RESTARTS_ENV, "0"))  # set by the launcher when it restarted this worker

        self._episodes: dict[str, asyncio.Task] = {}
        # Episodes that ended, as their tasks' done-callbacks say: a poll takes these instead of
        # looking at every running task (8k of them per worker at scale, many polls a second).
        self._ended: collections.deque[tuple[str, asyncio.Task]] = collections.deque()
        # Episodes that end together push their trajectories in one submit (one frame, one
        # acknowledgement message, one future) and report it in one /finish_rollout.
        self._deliveries: TickBatcher[tuple[list, list]] = TickBatcher(self._send_deliveries)
        self._finishes: TickBatcher[tuple[str, int, int]] = TickBatcher(self._send_finishes)
        self._next_allocate_time = 0.0
        self._refusal_backoff = REFUSAL_BACKOFF_S[0]
        self.counters: collections.Counter = collections.Counter()
        self.refusals: collections.Counter = collections.Counter()
        self._last_stats_time = time.monotonic()
        self.logger.info(
            "rollout worker %d/%d: %d prompts in shard (%d skipped as longer than %d tokens), manager %s",
            self.info.worker_index,
            self.info.worker_count,
            len(self.prompts),
            self.n_skipped_prompts,
            config.max_prompt_len,
            self.manager_url,
        )

    def _load_prompts(self, cfg: RolloutWorkerConfig) -> tuple[list[PromptRecord], int]:
        """This worker's shard, rendered the way evaluation renders it (realrl/impl/datasets.py)."""
        from transformers import AutoTokenizer

        from realrl.impl import datasets

        records = datasets.load_records(cfg.dataset_path, cfg.dataset)
        shard = records[self.info.worker_index :: self.info.worker_count]
        if not shard:
            raise ValueError(
                f"rollout worker {self.info.worker_index}/{self.info.worker_count} has no prompts: "
                f"{cfg.dataset_path} holds only {len(records)} records"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        prompts, skipped = [], 0
        rows = []  # each prompt's row in the dataset file (its rollout ids name it: docs/design.md §12)
        for k, r in enumerate(shard):
            kept, n_skipped = datasets.prompt_records([r], self.tokenizer, cfg.dataset, cfg.max_prompt_len)
            skipped += n_skipped
            if kept:
                prompts += kept
                rows.append(self.info.worker_index + k * self.info.worker_count)
        if prompts:
            templated = "messages" in prompts[0].row and cfg.dataset.chat_template
            self.logger.info(
                "prompts as %s, e.g. %r",
                "the chat template renders them" if templated else "raw text",
                prompts[0].prompt[:300],
            )
        self.rows = np.asarray(rows, dtype=np.int64)
        if not prompts:
            raise ValueError(
                f"rollout worker {self.info.worker_index}: all {len(shard)} prompts of its shard of "
                f"{cfg.dataset_path} are empty or longer than max_prompt_len={cfg.max_prompt_len} tokens"
            )
        return prompts, skipped

    def _wait_for_key(self, key: str) -> str:
        """name_resolve.wait, but leaving early if the trial ends meanwhile."""
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while True:
            try:
                return name_resolve.wait(key, timeout=1.0)
            except TimeoutError:
                if self._check_exit_conditions():
                    raise RuntimeError(f"exiting ({self.exit_reason}) while waiting for {key}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{key} did not appear within {SETUP_TIMEOUT_S:.0f}s") from None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.cfg.shuffle:
            return np.arange(len(self.prompts))
        rng = np.random.default_rng([self.cfg.seed, self.info.worker_index, epoch])
        return rng.permutation(len(self.prompts))

    def _next_prompt(self) -> PromptRecord:
        """The next prompt to offer: first those a resumed trial must generate
        again, then the shard in this epoch's order. The cursor is published
        before the prompt can be offered (the recovery ledger relies on it)."""
        if self._redo:
            record = self._redo.popleft()
            record.metadata["redo"] = True
            return record
        while True:
            if self._position == len(self._order):
                self.epoch += 1
                self._order = self._epoch_order(self.epoch)
                self._position = self._cursor_published = 0
                self.logger.info("starting epoch %d", self.epoch)
            record = self._record(self.epoch, self._position)
            self._position += 1
            if self._position > self._cursor_published:
                self._publish_cursor(ahead=self._next_cursor_ahead())
            # Past the cursor, the ledger may still hold a rollout (one finished between the
            # cursor's reading and the checkpoint's end): done is done.
            if not self._ledger.is_done(record.metadata["rollout_id"]):
                return record

    def _record(self, epoch: int, position: int) -> PromptRecord:
        order = self._order if epoch == self.epoch else self._epoch_order(epoch)
        return self._make_record(int(order[position]), epoch)

    def _make_record(self, index: int, epoch: int) -> PromptRecord:
        base = self.prompts[index]
        return PromptRecord(
            qid=f"{base.qid}@{epoch}",
            prompt=base.prompt,
            prompt_ids=list(base.prompt_ids),
            solutions=list(base.solutions),
            task=base.task,
            row=base.row,
            # One id per prompt and epoch, the same when generated again (docs/design.md §12):
            # the manager's calls are idempotent per id, the trainers drop a second copy by it,
            # and its prefix names this worker (a restarted one releases its predecessor's).
            metadata=dict(
                query_id=base.qid,
                epoch=epoch,
                rollout_id=rollout_id(self.info.worker_index, epoch, int(self.rows[index])),
            ),
        )

    def _reset_at_manager(self) -> ResetRolloutWorkerReply:
        """`/reset_rollout_worker` for this worker's index (blocking: `_read_training_start` runs in a thread)."""
        import urllib.request

        request = urllib.request.Request(
            f"{self.manager_url}/reset_rollout_worker",
            data=json.dumps(to_json(ResetRolloutWorkerRequest(self.info.worker_index))).encode(),
            headers={"Content-Type": "application/json", **trial_secret.http_headers()},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=MANAGER_CALL_TIMEOUT_S) as resp:
            return from_json(ResetRolloutWorkerReply, json.loads(resp.read()))

    def _next_cursor_ahead(self) -> int:
        """How far ahead to publish the cursor now: the last write's lead took
        `elapsed` seconds to use up, so the next one lasts about CURSOR_PERIOD_S."""
        now = time.monotonic()
        if self._cursor_time is not None:
            elapsed = max(now - self._cursor_time, 1e-3)
            scaled = int(self._cursor_ahead * CURSOR_PERIOD_S / elapsed)
            self._cursor_ahead = max(CURSOR_AHEAD, min(CURSOR_AHEAD_MAX, scaled))
        self._cursor_time = now
        return self._cursor_ahead

    def _publish_cursor(self, ahead: int = 0) -> None:
        """Publishes a cursor up to `ahead` prompts past the real one (one
        name-service write per `ahead` prompts): a resumed trial then treats
        those as issued and unfinished, and generates them, once."""
        self._cursor_published = min(len(self._order), self._position + ahead)
        cursor = {"epoch": self.epoch, "position": self._cursor_published, "regenerated": self.n_regenerated}
        name_resolve.add(
            names.rollout_cursor(self.experiment_name, self.trial_name, self.info.worker_index),
            json.dumps(cursor),
            replace=True,
            delete_on_exit=False,
        )

    def _read_training_start(self) -> bool:
        """Waits (non-blocking) for the master's training_start, then takes up
        the ledger (docs/design.md §12): every prompt this worker index issued
        before its cursor that is not done is generated again, once, before
        the shard goes on from the cursor. A resumed trial's training_start
        names the checkpoint's ledger and cursor; a restarted worker (the
        launcher replaced one that died) adds what the manager saw finished
        since and its predecessor's published cursor, and the manager releases
        its predecessor's running rollouts (generated again under their ids)."""
        try:
            start = json.loads(name_resolve.get(names.training_start(self.experiment_name, self.trial_name)))
        except name_resolve.NameEntryNotFoundError:
            return False
        ledger = Ledger.load(start["ledger"]) if start.get("ledger") else Ledger()
        cursor = (start.get("rollout_cursors") or {}).get(str(self.info.worker_index))
        cursors = [cursor] if cursor else []
        regenerated_before = 0
        if self.restarts:
            reply = self._reset_at_manager()
            finished = Ledger.from_wire(reply.done)
            ledger.update(finished)
            published = self._published_cursor()
            if published:
                cursors.append(published)
                regenerated_before = int(published.get("regenerated", 0))
            self.logger.info(
                "took over from a failed rollout worker %d: %d of its running rollouts released, %d finished",
                self.info.worker_index,
                len(reply.rollout_ids),
                finished.count(),
            )
        self._ledger = ledger
        if cursors:
            epoch, position = max((int(c["epoch"]), int(c["position"])) for c in cursors)
            self.epoch, self._order, self._position = epoch, self._epoch_order(epoch), position
            self._redo.extend(
                self._make_record(i, e) for e, i in undone(ledger, self._epoch_order, self.rows, epoch, position)
            )
            self.n_regenerated = regenerated_before + len(self._redo)
            self.logger.info(
                "resuming at epoch %d position %d: %d prompts issued before are generated again "
                "(in flight, or not yet offered, when the ledger was written)",
                epoch,
                position,
                len(self._redo),
            )
        self._publish_cursor()
        return True

    def _published_cursor(self) -> dict | None:
        try:
            key = names.rollout_cursor(self.experiment_name, self.trial_name, self.info.worker_index)
            return json.loads(name_resolve.get(key))
        except name_resolve.NameEntryNotFoundError:
            return None

    # ---- the event loop ---------------------------------------------------------
    async def _setup_async(self) -> None:
        cfg = self.cfg
        self.manager = GserverManagerClient(
            self.manager_url, timeout_s=MANAGER_CALL_TIMEOUT_S, retries=cfg.request_retries
        )
        self.client = make_client(cfg.server_api, timeout_s=cfg.request_timeout)
        # The answers' stop ids: every eos id of generation_config.json, config.json and the tokenizer.
        self.stop_ids = eos_token_ids_in_dir(cfg.tokenizer_path, self.tokenizer)
        self.logger.info(
            "stop ids (eos of generation_config.json, config.json, tokenizer): %s",
            ", ".join(f"{i} {self.tokenizer.convert_ids_to_tokens(i)!r}" for i in sorted(self.stop_ids)),
        )
        if cfg.routing == "client":
            routing = ClientRouting(self.manager, self.info.worker_index)
        else:
            routing = ManagerRouting(self.manager)
        self.partial_rollout = PartialRolloutManager(
            routing,
            self.client,
            new_tokens_per_chunk=cfg.new_tokens_per_chunk,
            request_timeout=cfg.request_timeout,
            request_retries=cfg.request_retries,
            no_server_timeout=cfg.no_server_timeout,
            eos_token_ids=self.stop_ids,
            lora=cfg.lora,
        )
        self._endpoint_scope = contextlib.AsyncExitStack()
        if getattr(self.agent, "uses_chat_endpoint", False):
            host = self.bind_host
            port = network.find_free_port(self.experiment_name, self.trial_name, host=host)
            endpoint = await self._endpoint_scope.enter_async_context(shared_endpoint(host, port))
            name_resolve.add(
                names.chat_endpoint(self.experiment_name, self.trial_name, self.info.worker_index),
                endpoint.url,
                replace=True,
            )
            self.logger.info("OpenAI-compatible endpoint at %s", endpoint.url)

    async def _poll_async(self) -> PollResult:
        try:
            return await self._poll_once()
        except Exception as e:
            # When the trial ends, the manager and the servers exit on their own
            # schedule; errors from their going away are expected then. Any
            # other time the error fails the worker (and the trial).
            if self._check_exit_conditions():
                self.logger.warning(
                    "ignoring an error while the trial ends (%s): %s: %s", self.exit_reason, type(e).__name__, e
                )
                return PollResult()
            raise

    async def _poll_once(self) -> PollResult:
        if not self._training_started:  # nothing is admitted before it anyway
            self._training_started = await asyncio.to_thread(self._read_training_start)
            if not self._training_started:
                await asyncio.sleep(0.1)
                return PollResult()
        finished = self._reap_episodes()
        started = 0
        while len(self._episodes) < self.cfg.max_concurrent_rollouts and time.monotonic() >= self._next_allocate_time:
            room = min(self.cfg.max_concurrent_rollouts - len(self._episodes), ALLOCATE_BATCH)
            while len(self._pending) < room:
                self._pending.append(self._next_prompt())
            offered = self._pending[:room]
            asked = time.monotonic()
            reply = await self.manager.allocate_rollouts(
                [(r.metadata["rollout_id"], r.qid) for r in offered], wait_s=ALLOCATE_WAIT_S
            )
            admitted = reply.admitted
            for k, record in enumerate(offered[:admitted]):  # started in one go: their first rounds go out together
                priority = (self.counters["episodes_started"] + k) // self.cfg.episodes_per_priority
                task = self._episodes[record.qid] = asyncio.create_task(
                    self._run_episode(record, priority), name=f"episode {record.qid}"
                )
                task.add_done_callback(lambda t, qid=record.qid: self._ended.append((qid, t)))
            del self._pending[:admitted]
            self.counters["episodes_started"] += admitted
            started += admitted
            if admitted < len(offered):
                reason = reply.reason or "unknown"
                self.refusals[_reason_kind(reason)] += 1
                if admitted or time.monotonic() - asked >= ALLOCATE_WAIT_S:  # admission moved or waited: ask again
                    break
                # Refused at once (e.g. rollouts stopped): back off.
                self._next_allocate_time = time.monotonic() + self._refusal_backoff
                self._refusal_backoff = min(REFUSAL_BACKOFF_S[1], self._refusal_backoff * 2)
                break
            self._refusal_backoff = REFUSAL_BACKOFF_S[0]
        if time.monotonic() - self._last_stats_time >= STATS_INTERVAL_S:
            self._log_stats()
        return PollResult(sample_count=started + finished)

    def _progress_info(self) -> dict:
        c = self.counters
        return {
            "episodes": len(self._episodes),
            "started": c["episodes_started"],
            "pushed": c["trajectories_pushed"],
            "push_queue": self._delivery.in_flight,
            "epoch": self.epoch,
        }

    def _reap_episodes(self) -> int:
        """Drop finished episodes; an episode's exception fails the worker."""
        n = 0
        while self._ended:
            qid, task = self._ended.popleft()
            if self._episodes.get(qid) is not task:  # (dropped at teardown)
                continue
            del self._episodes[qid]
            n += 1
            if task.cancelled():
                raise RuntimeError(f"episode {qid} was cancelled")
            task.result()  # raises the episode's error
        return n

    async def _run_episode(self, record: PromptRecord, priority: int) -> None:
        EPISODE_PRIORITY.set(priority)  # this task's (and its children's) generation requests carry it
        redo = record.metadata.get("redo", False)
        env = make_env(self.cfg.env.type, **self.cfg.env.args)
        try:
            trajectories = await self.agent.run_episode(record, env, self.partial_rollout)
        finally:
            await env.close()

        # The rollout is reported finished only once the trainer's puller
        # acknowledged all of its trajectories (docs/design.md §12). A copy the
        # puller already had (this rollout was delivered by a predecessor that
        # died before its finish) is in the trainer's hands as well: it counts;
        # one restored from the checkpoint the trial resumed from is too, but
        # the resumed trial counted it already: it does not. Each trajectory
        # says how many its rollout has: only a rollout whose trajectories the
        # trainers all took is done at a checkpoint. Other episodes'
        # trajectories travel meanwhile (AckedPusher's window); one
        # unacknowledged past its bound fails the episode, and the worker
        # (PushNotAcknowledged).
        rid = record.metadata["rollout_id"]
        for index, traj in enumerate(trajectories):
            traj.rollout_id, traj.index, traj.rollout_size = rid, index, len(trajectories)
        acks = await self._deliveries.submit(
            None, ([traj.to_wire() for traj in trajectories], [traj.key for traj in trajectories])
        )
        n_tokens = held = 0
        for index, (traj, ack) in enumerate(zip(trajectories, acks)):
            verdict = str(ack.get("verdict"))
            self.counters[f"trajectories_{verdict}"] += 1
            if verdict == "restored":
                continue
            if verdict not in ("taken", "duplicate"):
                self.logger.error("the trainer refused trajectory %s of %s: %s", index, traj.qid, verdict)
                continue
            held += 1
            n_tokens += traj.n_tokens
            self.counters["trajectories_pushed"] += 1
            self.counters["tokens_pushed"] += traj.n_tokens
            if (
                self._sample_file is not None
                and (self.counters["trajectories_pushed"] - 1) % self.cfg.sample_log_every == 0
            ):
                self._write_sample(record, traj)
        if redo:
            # What a predecessor delivered is in the trainers' hands even when this run (the
            # agent now rejects, or returns fewer) did not push it: it counts (docs/design.md §12).
            # Asked after this run's acknowledgements: the puller answers in the order it received.
            # (The puller answers once it read what else waits: a predecessor's frames first.)
            question = self._delivery.submit([{HELD_QUERY: rid}], [(rid, None)], in_order=False)
            (ack,) = await asyncio.wrap_future(question)
            delivered = int(ack.get("held", 0))
            if delivered > held:
                self.counters["trajectories_delivered_before"] += delivered - held
                held = delivered
        if faults.armed():  # (a thread hop per episode only in a test that arms points: one may hold)
            await asyncio.to_thread(faults.point, "rollout_worker.acknowledged")  # delivered, not finished
        await self._finishes.submit(None, (rid, held, n_tokens))
        self.counters["episodes_accepted" if held else "episodes_rejected"] += 1
        if redo:
            if faults.armed():
                await asyncio.to_thread(faults.point, "rollout_worker.redo_finished")

    async def _send_deliveries(self, _key, episodes: list[tuple[list, list]]) -> list[list]:
        """The trajectories of episodes that ended together, as one `AckedPusher.submit`;
        each episode gets its own acknowledgements back."""
        acks = await asyncio.wrap_future(
            self._delivery.submit([m for ms, _ in episodes for m in ms], [k for _, ks in episodes for k in ks])
        )
        out, start = [], 0
        for messages, _ in episodes:
            out.append(acks[start : start + len(messages)])
            start += len(messages)
        return out

    async def _send_finishes(self, _key, finished: list[tuple[str, int, int]]) -> list[None]:
        await self.manager.finish_rollouts(finished)
        return [None] * len(finished)

    # ---- logs ---------------------------------------------------------------------
    def _write_sample(self, record: PromptRecord, traj: Trajectory) -> None:
        line = {
            "qid": traj.qid,
            "task": traj.task,
            "time": time.time(),
            "prompt": record.prompt,
            "solutions": record.solutions,
            "version_start": traj.version_start,
            "version_end": traj.version_end,
            "answers": [
                self.tokenizer.decode(traj.completion_ids(i).tolist(), skip_special_tokens=True)
                for i in range(traj.group_size)
            ],
            "scores": traj.scores,
            "reward": traj.reward,
            "no_eos": traj.no_eos,
            "completion_lens": [len(traj.completion_ids(i)) for i in range(traj.group_size)],
            # tokens the policy sampled (trained); a multi-turn sequence's
            # answer also shows the context between its turns
            "sampled_lens": [int(m.sum()) for m in traj.loss_mask]
            or [len(traj.completion_ids(i)) for i in range(traj.group_size)],
        }
        if isinstance(traj.metadata.get("turns"), list):  # chat calls per sequence (function / external agents)
            line["turns"] = traj.metadata["turns"]
        self._sample_file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._sample_file.flush()

    def _log_stats(self) -> None:
        now = time.monotonic()
        elapsed, self._last_stats_time = now - self._last_stats_time, now
        agent_stats = self.agent.pop_stats()
        generation = self.partial_rollout.stats.pop()
        c = self.counters
        self.logger.info(
            "epoch %d | episodes running %d started %d accepted %d rejected %d | trajectories pushed %d "
            "(resent %d, unknown acknowledgements %d) (%.1f tokens/s) | agent %s | generation %s | refusals %s "
            "| skipped prompts %d",
            self.epoch,
            len(self._episodes),
            c["episodes_started"],
            c["episodes_accepted"],
            c["episodes_rejected"],
            c["trajectories_pushed"],
            self._delivery.n_resent,
            self._delivery.n_unknown_acks,
            generation["generated_tokens"] / max(elapsed, 1e-9),
            {k: round(v, 3) for k, v in agent_stats.items()},
            generation,
            dict(self.refusals),
            self.n_skipped_prompts,
        )

    # ---- exit -----------------------------------------------------------------------
    async def _teardown_async(self) -> None:
        if self._episodes:
            self.logger.info("cancelling %d running episodes", len(self._episodes))
        for task in self._episodes.values():
            task.cancel()
        await asyncio.gather(*self._episodes.values(), return_exceptions=True)
        self._episodes.clear()
        await self._deliveries.close()
        await self._finishes.close()
        if getattr(self, "_endpoint_scope", None) is not None:
            await self._endpoint_scope.aclose()
        if getattr(self, "partial_rollout", None) is not None:
            await self.partial_rollout.close()
        self._log_stats()
        if getattr(self, "manager", None) is not None:
            self.logger.info(
                "manager calls per path: %s; trajectory frames sent %d",
                dict(self.manager.calls.most_common()),
                self._delivery.n_frames,
            )
        for client in (getattr(self, "client", None), getattr(self, "manager", None)):  # None: setup did not get there
            if client is not None:
                await client.close()

    def _exit_hook(self) -> None:
        delivery = getattr(self, "_delivery", None)
        if delivery is not None:
            self.request_exit("shutting down")
            delivery.close("worker exiting while trajectories were waiting for the trainer")
        if getattr(self, "pusher", None) is not None:
            # Flush queued trajectories when the trial completed (they are
            # accounted for); an aborted trial has nobody left to take them.
            self.pusher.close(**({} if self.trial_complete else {"linger": 0}))
        if getattr(self, "_sample_file", None) is not None:
            self._sample_file.close()


def _reason_kind(reason: str) -> str:
    """'staleness bound: 16 // 8 > 0 + 1' -> 'staleness bound' (counted by kind)."""
    return re.split(r"[:(]", reason, maxsplit=1)[0].strip() or reason
