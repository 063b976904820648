"""RolloutWorker in small trials of real processes (generation_server,
gserver_manager, rollout workers) through the local launcher, with the
trainer's puller in the test process: trajectories arrive and validate, the
staleness bound holds exactly (η = 0, no trainer), a new weight version admits
the next batch, samples are logged, a failing episode fails the worker, and
agents outside realrl drive episodes through the worker's OpenAI-compatible
endpoint."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import aiohttp
import numpy as np
import openai
import pytest

from realrl.api.agent_api import AgentSettings
from realrl.api.cli_args import AgentConfig
from realrl.api.system_api import RolloutWorkerConfig
from realrl.api.trajectory import Sampling, Trajectory
from realrl.base import names, trial_secret
from realrl.impl.math_data import load_math_jsonl, write_jsonl
from realrl.impl.tiny_model import build_tiny_model
from realrl.system.push_pull_stream import NameResolvingZmqPuller
from tests.impl.conftest import save_perturbed
from tests.impl.openai_compat.chat_kit import char_chat_tokenizer
from tests.system.conftest import TINY
from tests.system.test_partial_rollout import (  # noqa: F401  (fixtures)
    EXP,
    HealthOnlyServer,
    manager_group,
    manager_stats,
    server_group,
)
from tests.system.trial_thread import TrialThread, wait_until

MAX_PROMPT_LEN = 24


@pytest.fixture(scope="module")
def dataset(tiny_kit, tmp_path_factory) -> str:
    """7 prompts, one too long for max_prompt_len: 3 usable per worker shard,
    so a few batches already cycle through epochs."""
    records = load_math_jsonl(tiny_kit["train_path"])[:7]
    records[2] = dict(records[2], prompt="Q: " + "1+" * 40 + "1=?\nA:", answer="41", solutions=["41"])
    path = str(tmp_path_factory.mktemp("rw_data") / "train.jsonl")
    write_jsonl(path, [{k: r[k] for k in ("query_id", "prompt", "answer", "task")} for r in records])
    return path


def rollout_group(tiny_kit, dataset: str, count: int, agent: str = "single-step", top_p: float = 1.0, **kwargs) -> list:
    from realrl.launcher.local import WorkerGroup

    gconfig = {"max_new_tokens": 6, "temperature": 1.0, "top_p": top_p}
    config = RolloutWorkerConfig(
        dataset_path=dataset,
        tokenizer_path=tiny_kit["model_dir"],
        max_prompt_len=kwargs.pop("max_prompt_len", MAX_PROMPT_LEN),
        agent=AgentConfig(type=agent),
        agent_settings=AgentSettings(tokenizer_path=tiny_kit["model_dir"], group_size=2, gconfig=gconfig),
        n_pullers=1,
        **kwargs,
    )
    return WorkerGroup("rollout_worker", count, config, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})


def pull_acked(puller, timeout: float) -> list[Trajectory]:
    """What arrives within `timeout`, each acknowledged as the trainer's puller does
    (a rollout worker reports a rollout finished only once its trajectories are)."""
    got = []
    for sender, message in puller.pull_with_senders(timeout=timeout):
        traj = Trajectory.from_wire(message)
        puller.acknowledge(sender, [{"rollout_id": traj.rollout_id, "index": traj.index, "verdict": "taken"}])
        got.append(traj)
    return got


def pull_all(puller, want: int, timeout: float = 180.0) -> list[Trajectory]:
    got: list[Trajectory] = []
    deadline = time.monotonic() + timeout
    while len(got) < want:
        if time.monotonic() > deadline:
            pytest.fail(f"only {len(got)} of {want} trajectories arrived")
        got += pull_acked(puller, 0.1)
    return got


def query_id(qid: str) -> str:
    return qid.rsplit("@", 1)[0]


def test_trajectories_arrive_and_staleness_bound_holds(tmp_path, etcd_server, tiny_kit, dataset):
    batch = 4  # train_batch_size; η = 0 and no trainer: version 0 admits exactly one batch
    weights_dir = tmp_path / "weights"
    groups = [
        server_group(tiny_kit["model_dir"]),
        manager_group(
            n_servers=1,
            train_batch_size=batch,
            max_head_offpolicyness=0,
            max_concurrent_rollouts=16,
            weights_dir=str(weights_dir),
            n_rollout_workers=2,
        ),
        rollout_group(tiny_kit, dataset, 2, top_p=0.9, max_concurrent_rollouts=3, sample_log_every=2),
    ]
    trial = TrialThread(tmp_path, etcd_server.addr, groups, EXP)
    puller = None
    try:
        trial.start()  # the launcher also points this process's name_resolve at the trial
        trial.start_training()
        puller = NameResolvingZmqPuller(EXP, trial.trial, 0)
        manager_url = trial.wait_key(names.gen_server_manager(EXP, trial.trial))

        def quiet_at(accepted: int) -> dict:
            """Waits until `accepted` rollouts finished and none runs: every
            trajectory of them has been pushed (push comes before finish)."""
            return wait_until(
                lambda: (lambda s: s if s["accepted"] == accepted and s["running"] == 0 else None)(
                    manager_stats(manager_url)
                ),
                180,
                f"{accepted} accepted rollouts and none running",
            )

        first = pull_all(puller, batch)
        stats = quiet_at(batch)
        first += pull_acked(puller, 0.5)
        assert len(first) == batch, "the staleness bound let more than one batch through at version 0"
        assert stats["rejected"] == 0 and stats["trainer_version"] == 0
        for traj in first:
            assert traj.group_size == 2 and traj.qid.rsplit("@", 1)[1] in ("0", "1")
            assert all(v == 0 for v in traj.version_start + traj.version_end)
            assert all(len(ids) - plen <= 6 for ids, plen in zip(traj.input_ids, traj.prompt_len))
            # what each answer was sampled with, and its logprobs under the nucleus it was drawn from
            assert traj.sampling == [Sampling(1.0, top_p=0.9)] * 2
            for lp, slp in zip(traj.logprobs, traj.sampling_logprobs):
                assert len(slp) == len(lp) and np.all(slp >= lp - 1e-6)
        assert any(np.any(s > lp) for t in first for s, lp in zip(t.sampling_logprobs, t.logprobs))

        # The trainer publishes version 1: the manager loads it on the server
        # and admits exactly one more batch.
        save_perturbed(tiny_kit["model_dir"], str(weights_dir / "1"), seed=5)
        trial.set(names.model_version(EXP, trial.trial, "actor"), "1")
        second = pull_all(puller, batch)
        stats = quiet_at(2 * batch)
        second += pull_acked(puller, 0.5)
        assert len(second) == batch and stats["trainer_version"] == stats["version"] == 1
        wait_until(lambda: manager_stats(manager_url)["loaded_version"] == 1, 60, "the server to load version 1")
        everything = first + second
        qids = [t.qid for t in everything]
        assert len(set(qids)) == len(qids), f"episode qids repeat across epochs: {qids}"
        # Every trajectory names its rollout: `<worker>:<epoch>:<dataset row>`, one per prompt and epoch.
        for traj in everything:
            worker, epoch, row = (int(x) for x in traj.rollout_id.split(":"))
            assert traj.index == 0 and traj.qid.rsplit("@", 1)[1] == str(epoch) and row % 2 == worker
        assert len({t.rollout_id for t in everything}) == len(everything)
        assert any(q.endswith("@1") for q in qids)  # 6 usable prompts, 8 episodes: epochs cycle
        for traj in everything:
            assert all(set(v.tolist()) <= {0, 1} for v in traj.versions)

        # Sharding and prompt filtering: worker i got records[i::2], minus the long prompt.
        records = load_math_jsonl(dataset)
        shards = [{r["query_id"] for r in records[i::2] if len(r["prompt"]) <= MAX_PROMPT_LEN} for i in range(2)]
        long_qid = records[2]["query_id"]
        assert long_qid not in {query_id(q) for q in qids}
        for i in range(2):
            pushed = [t for t in everything if query_id(t.qid) in shards[i]]
            path = os.path.join(trial.launcher.log_dir, "samples", f"rollout-{i}.jsonl")
            lines = [json.loads(line) for line in open(path)]
            # every 2nd trajectory of each worker (the 1st, 3rd, ...) is logged
            assert len(lines) == math.ceil(len(pushed) / 2)
            by_qid = {t.qid: t for t in pushed}
            for line in lines:
                traj = by_qid[line["qid"]]
                assert line["reward"] == pytest.approx(traj.reward) and len(line["answers"]) == 2
                assert line["version_start"] == traj.version_start and line["version_end"] == traj.version_end
                assert line["prompt"] == next(r["prompt"] for r in records if r["query_id"] == query_id(line["qid"]))
            log = open(trial.launcher.log_path("rollout_worker", i)).read()
            skipped = int(long_qid in {r["query_id"] for r in records[i::2]})
            assert f"({skipped} skipped as longer than {MAX_PROMPT_LEN} tokens)" in log
            assert "collector thresholds (50000, 50, 1000)" in log  # full collections rare (RolloutWorker)

        trial.set(names.experiment_status(EXP, trial.trial), "COMPLETE")
        assert trial.join() == 0
        for i in range(2):
            log = open(trial.launcher.log_path("rollout_worker", i)).read()
            assert "exited with code 0" in log
    finally:
        if puller is not None:
            puller.close()
        trial.close()


def test_failing_episode_fails_the_worker_loudly(tmp_path, etcd_server, tiny_kit, dataset, capfd):
    fake = HealthOnlyServer()  # the manager accepts it at start-up; then it goes away
    groups = [manager_group(n_servers=1), rollout_group(tiny_kit, dataset, 1, request_retries=1, no_server_timeout=2)]
    trial = TrialThread(tmp_path, etcd_server.addr, groups, EXP)
    puller = None
    try:
        trial.start()
        trial.start_training()
        puller = NameResolvingZmqPuller(EXP, trial.trial, 0)
        trial.set(names.gen_server(EXP, trial.trial, 0), fake.url)
        trial.wait_key(names.gen_server_manager(EXP, trial.trial))
        fake.stop()
        assert trial.join() == 1
        assert trial.launcher.failed_worker == "rollout_worker/0"
        err = capfd.readouterr().err
        assert "worker rollout_worker/0 failed" in err
        # The only server is gone for good: after waiting rollout.no_server_timeout for one, the episode fails.
        assert "PartialRolloutError" in err and fake.url in err and "rollout.no_server_timeout=2" in err
        assert puller.pull(timeout=0.2) == []
    finally:
        fake.stop()
        if puller is not None:
            puller.close()
        trial.close()


@pytest.fixture(scope="module")
def chat_kit(tmp_path_factory) -> dict:
    """The tiny random Llama with a tokenizer that has a tool-call chat template."""
    tokenizer = char_chat_tokenizer()
    model_dir = str(tmp_path_factory.mktemp("chat_kit") / "model")
    build_tiny_model(tokenizer, TINY, seed=3).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"model_dir": model_dir}


async def external_agent(endpoint: str, episodes: int) -> list[tuple[str, float]]:
    """An agent process outside realrl: per episode, open it, make two chat
    calls (the second continues the first), close it with a reward."""
    done = []
    async with aiohttp.ClientSession(headers=trial_secret.http_headers()) as http:  # it reads the trial's key
        while len(done) < episodes:
            async with http.post(f"{endpoint}/rl/episodes", json={"wait_s": 5}) as resp:
                opened = await resp.json()
            if opened["episode_id"] is None:
                continue
            client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key=trial_secret.http_api_key())
            messages = list(opened["row"]["messages"])
            first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages += [first.choices[0].message, {"role": "user", "content": "Again?"}]
            await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            await client.close()
            reward = float(all(qid != opened["qid"] for qid, _ in done))  # 1 for a prompt's first episode
            url = f"{endpoint}/rl/episodes/{opened['episode_id']}/close"
            async with http.post(url, json={"reward": reward}) as resp:
                assert resp.status == 200 and (await resp.json())["turns"] == 2
            done.append((opened["qid"], reward))
    return done


def test_external_agents_drive_episodes_through_the_workers_endpoint(tmp_path, etcd_server, chat_kit, dataset):
    """Admission as usual (η = 0, batch 2: two prompts of two episodes each),
    the episodes offered at the worker's registered endpoint, and each
    prompt's episodes pushed as one trajectory of recorded turns."""
    groups = [
        server_group(chat_kit["model_dir"]),
        manager_group(n_servers=1, train_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=4),
        # (prompts go through the kit's chat template: longer than the raw text)
        rollout_group(chat_kit, dataset, 1, agent="external", max_concurrent_rollouts=4, max_prompt_len=256),
    ]
    trial = TrialThread(tmp_path, etcd_server.addr, groups, EXP)
    puller = None
    try:
        trial.start()
        trial.start_training()
        puller = NameResolvingZmqPuller(EXP, trial.trial, 0)
        endpoint = trial.wait_key(names.chat_endpoint(EXP, trial.trial, 0))
        assert endpoint.startswith("http://127.0.0.1:")
        episodes = asyncio.run(external_agent(endpoint, 4))
        trajectories = pull_all(puller, 2)
        assert sorted(t.qid for t in trajectories) == sorted({qid for qid, _ in episodes})
        for traj in trajectories:
            assert sum(traj.metadata["turns"]) == 4 and traj.loss_mask  # 2 episodes x 2 calls, in chains
            assert sorted(traj.metadata["episode_scores"]) == [0.0, 1.0]
            turns = traj.metadata["turns"]
            assert all(0 < traj.loss_mask[i].sum() <= 4 * turns[i] for i in range(traj.group_size))
        trial.set(names.experiment_status(EXP, trial.trial), "COMPLETE")
        assert trial.join() == 0
    finally:
        if puller is not None:
            puller.close()
        trial.close()
