"""The trainer's side of `weights.transport=broadcast` (realrl/system/weight_broadcast.py,
docs/design.md §8): without an epoch it leaves the version to the disk path;
with one, each version goes through the group, is announced in order, with
`weights_sent` saying which group carried it, and is written to disk only
when the manager asks (`weights_wanted`), also between versions; and the
manager with its servers through epochs, failures and restarts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import uuid

import pytest
import torch

from realrl.api.system_api import WeightTransportConfig
from realrl.base import name_resolve, names, trial_secret
from realrl.impl.generation.torch_server.weights import read_weights_dir
from realrl.impl.weights.broadcast import GroupSpec, Receiver, StoreServer, published_tensors
from realrl.system.model_worker import publish_weights
from realrl.system.weight_broadcast import BroadcastPublisher
from tests.impl.weights.models import tiny_model, train_a_little
from tests.system.trial_thread import wait_until

HOST = "127.0.0.1"


def test_each_version_goes_through_the_group_and_is_written_to_disk_only_when_the_manager_asks(tmp_path):
    exp, trial = "wire-test", uuid.uuid4().hex[:8]
    model = tiny_model("tied", seed=1)
    weights_dir = str(tmp_path / "weights")
    announced: list[tuple[int, bool]] = []
    publisher = BroadcastPublisher(
        WeightTransportConfig(transport="broadcast"),
        model,
        None,
        lambda v, state: publish_weights(model, weights_dir, v, state_dict=state),
        exp,
        trial,
        HOST,
    )
    announce = lambda v: announced.append((v, os.path.isdir(os.path.join(weights_dir, str(v)))))  # noqa: E731
    assert not publisher.publish(1, None, announce)  # no epoch yet: the disk path's turn
    publish_weights(model, weights_dir, 1)
    store = StoreServer(HOST)
    spec = GroupSpec(f"realrl-{trial}-e1", HOST, store.port, 2, timeout_s=30)
    received: list[int] = []
    member = Receiver(spec, 1, b"", HOST, check=lambda m: None, on_version=lambda v, t: received.append(v))
    name_resolve.add(names.weights_group(exp, trial, "actor"), json.dumps(spec.to_json()), replace=True)
    wanted = names.weights_wanted(exp, trial, "actor")
    try:
        train_a_little(model, 2)
        assert publisher.publish(2, None, announce)
        assert publisher.sender.wait_idle(60)
        v2 = {name: t.clone() for name, t in published_tensors(model).items()}
        # Asked for version 2 once it was sent: written between versions, from the snapshot kept.
        name_resolve.add(wanted, "2", replace=True)
        wait_until(lambda: os.path.isdir(os.path.join(weights_dir, "2")), 30, "version 2 written on demand")
        name_resolve.add(wanted, "3", replace=True)  # asked for before it is sent: written before it is announced
        for version in (3, 4):
            train_a_little(model, version)
            assert publisher.publish(version, None, announce)
            assert publisher.sender.wait_idle(60)
        sent = json.loads(name_resolve.get(names.weights_sent(exp, trial, "actor")))
    finally:
        publisher.close()
        member.join(30)
        store.close()
    assert received == [2, 3, 4] and member.closed and member.error is None
    assert announced == [(2, False), (3, True), (4, False)]  # in order; on disk only when asked for
    assert sorted(os.listdir(weights_dir)) == ["1", "2", "3"]  # (1: the disk path's)
    assert sent == {"group": spec.name, "version": 4, "ok": True}
    on_disk = read_weights_dir(os.path.join(weights_dir, "2"))
    for name, t in v2.items():
        assert torch.equal(on_disk[name], t), name


def test_the_first_epochs_sender_is_made_and_its_group_formed_before_the_first_version(tmp_path):
    """`prepare` (the model worker's, before its first step): once the manager names the first
    group, its sender is made and the group forms while the trainer waits for a batch; the
    first publish takes that sender and its version goes through as any other."""
    exp, trial = "wire-test", uuid.uuid4().hex[:8]
    model = tiny_model("tied", seed=1)
    weights_dir = str(tmp_path / "weights")
    publisher = BroadcastPublisher(
        WeightTransportConfig(transport="broadcast"),
        model,
        None,
        lambda v, state: publish_weights(model, weights_dir, v, state_dict=state),
        exp,
        trial,
        HOST,
    )
    publisher.prepare(poll_s=0.05)
    store = StoreServer(HOST)
    spec = GroupSpec(f"realrl-{trial}-e1", HOST, store.port, 2, timeout_s=30)
    formed: list = []  # the tensor list, which the sender sets once the group formed
    received: dict[int, dict] = {}
    member = Receiver(
        spec,
        1,
        b"",
        HOST,
        check=formed.append,
        on_version=lambda v, t: received.update({v: {k: x.clone() for k, x in t.items()}}),
    )
    try:
        name_resolve.add(names.weights_group(exp, trial, "actor"), json.dumps(spec.to_json()), replace=True)
        wait_until(lambda: formed, 30, "the group formed before any version")
        sender = publisher.sender
        assert sender is not None and sender.spec.name == spec.name
        train_a_little(model, 1)
        assert publisher.publish(1, None, lambda v: None)
        assert publisher.sender is sender and sender.wait_sent(1, 60)
        v1 = published_tensors(model)
    finally:
        publisher.close()
        member.join(30)
        store.close()
    assert member.error is None and sorted(received) == [1] and not os.path.exists(weights_dir)
    for name, t in v1.items():
        assert torch.equal(received[1][name], t), name


@pytest.mark.parametrize("protocol", ["realrl", "sglang"])
def test_the_manager_takes_servers_through_epochs_and_a_server_killed_mid_version_rejoins(
    tmp_path, etcd_server, monkeypatch, protocol
):
    """`weights.transport=broadcast` through the manager (real manager and
    server workers; this process is the trainer), with two torch servers
    (`realrl`: their group routes) or two torch servers emulating SGLang
    0.5.23 (`sglang`: the manager joins them through SGLang's
    `/init_weights_update_group` once the sender is there and takes each
    through every version with SGLang's routes).

    The first epoch never forms: a member dies as the sender arrives, before
    the rendezvous (a fault point; SGLang: as its `/init_weights_update_group`
    begins). The manager abandons the epoch as soon as it learns (the dead
    server's health check, or its failed init) and the sender and the other
    member, waiting in the rendezvous, give up at once (not at the
    collective's 600 s timeout, nor SGLang's 30 minutes): version 1 reaches
    the servers from disk. Then an epoch of both (the killed one restarted)
    carries version 2; their version switches once the whole version is in
    place and they then answer as the trainer's weights do, the same as each
    other. A server killed in the middle of version 3's buckets (a fault
    point) is dropped from that epoch (each member is in a group of two with
    the sender): the other takes version 3 through its group, and a new
    epoch of both (the killed one restarted) carries the next versions.
    SGLang: a member that
    refuses one of version 5's buckets while it stays up (a fault point: its
    `/update_weights_from_distributed` fails before it joins the collective)
    does not hold the sender in that collective until its 600 s timeout: the
    manager destroys the group on it, which fails the sender's collective at
    once, and drops it from the epoch; the other takes version 5 through its
    group, the refusing one from disk, and a new epoch of both carries
    version 6. realrl: a member that is up but
    answers nothing (a fault point stops its process, SIGSTOP, between two of
    version 6's buckets) does not hold the sender in that collective until
    its 600 s timeout either: the manager's health checks take it out of
    routing and drop it from the epoch (`drop/<rank>`), the sender leaves its
    group within a look at the store, version 6 reaches the other server
    through its own group, and once the stalled server answers again
    (SIGCONT) a new epoch of both carries version 7. A member that stops
    with all of version 7's buckets received, before it holds the version,
    does not hold the manager's wait for it until its HTTP timeout either:
    its health checks end that wait and drop it, the other server holds 7,
    and once it answers again an epoch of both carries version 8."""
    import asyncio

    from realrl.base import faults

    armed = "weights.before_rendezvous=kill,weights.bucket_received=kill;after=test.kill_server"
    if protocol == "sglang":
        armed += ",weights.bucket_refused=fail_once;after=test.refuse_bucket"
    else:
        armed += ",weights.member_stalls=stop;after=test.stall_server"
        armed += ",weights.member_stalls_in_place=stop;after=test.stall_in_place"
    fault_dir = _armed(tmp_path, monkeypatch, armed)

    import aiohttp

    from realrl.impl.generation import make_client
    from tests.impl.weights.test_torch_server_group import forward_logprobs
    from tests.system.test_generation_server import EXP

    # Several buckets per version; a rendezvous timeout no step of the test may wait out.
    model, weights_dir, trial, publisher, announce = _two_servers_and_a_sender(tmp_path, etcd_server, protocol, 600.0)
    probe = [5, 6, 7, 8, 9]

    async def manager_version(session, url) -> int:
        async with session.get(url + "/get_model_version") as resp:
            return (await resp.json())["version"]

    manager_log = trial.launcher.log_path("gserver_manager", 0)
    known_urls: set[str] = set()  # the servers' urls so far (a restarted one comes back at a new one)

    async def wait_for_epoch_of_both() -> None:
        """The epoch the manager builds of both servers once the killed one is back (at its new url)."""
        for _ in range(2400):
            urls = [trial.get(names.gen_server(EXP, trial.trial, i)) for i in range(2)]
            back = [u for u in urls if u and u not in known_urls]
            log = open(manager_log).read()
            if back and (found := re.findall(rf"weight group (\S+): 2 servers \([^)]*{re.escape(back[0])}", log)):
                spec = trial.get(names.weights_group(EXP, trial.trial, "actor"))
                assert json.loads(spec)["name"] == found[-1], spec  # (the current epoch: the test waits for it)
                known_urls.update(urls)
                return
            await asyncio.sleep(0.05)
        raise AssertionError("no epoch of both servers after the restart")

    async def wait_for_an_epoch_after(name: str) -> None:
        """A new epoch of both servers once epoch `name` failed (no server restarted)."""
        for _ in range(1200):
            if (now := _current_epoch(trial)) != name and re.search(
                rf"weight group {now}: 2 servers", open(manager_log).read()
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no epoch after {name}")

    last = 6 if protocol == "sglang" else 8
    refused_in = None  # sglang: the epoch in which a member refused a bucket of version 5
    stalled_in = None  # realrl: the epoch in which a member stalled in version 6
    stalled_in_place = None  # realrl: the epoch in which a member stalled with all of version 7

    async def scenario(manager_url: str):
        nonlocal refused_in, stalled_in, stalled_in_place
        known_urls.update(trial.repo.get(names.gen_server(EXP, trial.trial, i)) for i in range(2))
        async with aiohttp.ClientSession(headers=trial_secret.http_headers()) as session:
            for version in range(1, last + 1):
                if version == 2:  # a member died as version 1's sender came: an epoch of both again
                    await wait_for_epoch_of_both()
                if version == 3:
                    (fault_dir / "test.kill_server").touch()  # a server dies in version 3's buckets
                if version == 4:  # the next version once the killed server is back in a new epoch of both
                    await wait_for_epoch_of_both()
                if version == 5 and protocol == "sglang":  # a member up refuses a bucket of version 5
                    refused_in = _current_epoch(trial)
                    (fault_dir / "test.refuse_bucket").touch()
                if version == 6 and protocol == "sglang":
                    await wait_for_an_epoch_after(refused_in)
                if version == 6 and protocol == "realrl":  # a member stalls between two of its buckets
                    stalled_in = _current_epoch(trial)
                    (fault_dir / "test.stall_server").touch()
                if version == 7 and protocol == "realrl":  # the stalled server answers again: an epoch of both
                    os.kill(faults.stopped_pid(str(fault_dir), "weights.member_stalls"), signal.SIGCONT)
                    await wait_for_an_epoch_after(stalled_in)
                    stalled_in_place = _current_epoch(trial)  # then a member stalls with all of version 7's buckets
                    (fault_dir / "test.stall_in_place").touch()
                if version == 8:  # that server answers again: a new epoch of both
                    # (first, version 7's update ends while it is still stopped: its wait did not hold it)
                    for _ in range(1200):
                        if "all servers hold weight version 7" in open(manager_log).read():
                            break
                        await asyncio.sleep(0.05)
                    assert "all servers hold weight version 7" in open(manager_log).read()
                    os.kill(faults.stopped_pid(str(fault_dir), "weights.member_stalls_in_place"), signal.SIGCONT)
                    await wait_for_an_epoch_after(stalled_in_place)
                train_a_little(model, version)
                if not publisher.publish(version, None, announce):  # no epoch yet: the disk path
                    publish_weights(model, weights_dir, version)
                    announce(version)
                for _ in range(1200):
                    if await manager_version(session, manager_url) == version:
                        break
                    await asyncio.sleep(0.05)
                assert await manager_version(session, manager_url) == version
        urls = [trial.repo.get(names.gen_server(EXP, trial.trial, i)) for i in range(2)]  # (one restarted)
        async with make_client("sglang", timeout_s=60) as client:
            held = [await client.weight_version(u) for u in urls]
            outs = [await client.generate(u, probe, {"max_new_tokens": 8, "temperature": 0.0}) for u in urls]
        return held, outs

    def resume_stalled() -> None:
        for point in ("weights.member_stalls", "weights.member_stalls_in_place"):
            _resume(faults.stopped_pid(str(fault_dir), point))

    held, outs = _run_scenario(trial, publisher, scenario, on_exit=resume_stalled)
    assert (
        held == [str(last)] * 2
        and faults.fired("weights.before_rendezvous")
        and faults.fired("weights.bucket_received")
    )
    assert outs[0].output_ids == outs[1].output_ids and outs[0].output_logprobs == outs[1].output_logprobs
    expected = forward_logprobs(model, probe, outs[0].output_ids)
    torch.testing.assert_close(torch.tensor(outs[0].output_logprobs), expected, atol=1e-4, rtol=0)
    log = open(trial.launcher.log_path("gserver_manager", 0)).read()
    routes = ", SGLang's routes" if protocol == "sglang" else "$"
    assert re.search(rf"weight group realrl-\S+-e1: 2 servers \(.*\){routes}", log, re.M), log[-3000:]
    # The first epoch, abandoned once the manager learnt its member was gone; version 1 by disk.
    assert re.search(r"weight group realrl-\S+-e1 abandoned: \S+ (is down|could not join)", log), log[-3000:]
    assert re.search(r"updating \d servers to weight version 1 from ", log), log[-3000:]
    given_up = "Failed to initialize custom process group" if protocol == "sglang" else "membership failed"
    # (the servers' own logs: a worker's log holds its server's lines only when that server died)
    server_logs = [
        open(os.path.join(trial.launcher.log_dir, f"generation_server-{i}.server.log")).read() for i in (0, 1)
    ]
    waited = True  # the member still up was waiting in the rendezvous
    if protocol == "sglang":  # (groups of two, formed in rank order: one ranked before the dead one formed its own)
        first = re.search(r"weight group (realrl-\S+-e1): 2 servers \(([^)]*)\)", log)
        dead = re.search(rf"weight group {first.group(1)}: (\S+) left it: could not join: generation server", log)
        waited = first.group(2).split(", ").index(dead.group(1)) == 0
    assert not waited or any(given_up in s for s in server_logs), server_logs  # it left the rendezvous
    assert "updating 2 servers to weight version 2 (broadcast)" in log, log[-3000:]
    assert re.search(
        r"weight group realrl-\S+-e\d+(: \S+ left it| failed|: \S+ did not get version| abandoned|: \S+ dropped)", log
    )
    # The killed one dropped (each member in a group of two with the sender), the other takes
    # version 3 through its group.
    assert re.search(r"updating \d servers to weight version 3 \(broadcast\)", log), log[-3000:]
    # A later epoch of both servers (the killed one back); the last epoch line may be one the
    # manager built as the trial's servers stopped, so not necessarily that one.
    epochs = re.findall(r"weight group realrl-\S+-e(\d+): (\d) servers", log)
    assert any(int(e) > 1 and n == "2" for e, n in epochs), epochs
    assert f"updating 2 servers to weight version {last} (broadcast)" in log, log[-3000:]
    assert f"all servers hold weight version {last}" in log
    if protocol == "sglang":  # the member that refused a bucket: dropped at once, version 5 by disk to it alone
        assert faults.fired("weights.bucket_refused")
        assert re.search(rf"weight group {refused_in}: \S+ dropped \(version 5: ", log), log[-3000:]
        assert not re.search(rf"weight group {refused_in} abandoned", log), log[-3000:]
        # (the other took it through its group: `holds`, whichever epoch is current when version 5 is announced)
        assert "weight version 5 is not on disk: the trainer is asked to write it" in log, log[-3000:]
    else:  # the member that stalled: out by its health checks and dropped, version 6 through the other's group
        assert faults.fired("weights.member_stalls")
        assert re.search(rf"weight group {stalled_in}: \S+ dropped \(", log), log[-3000:]
        assert not re.search(rf"weight group {stalled_in} abandoned", log), log[-3000:]
        assert re.search(r"updating \d servers to weight version 6 \(broadcast\)", log), log[-3000:]
        assert "updating 2 servers to weight version 7 (broadcast)" in log, log[-3000:]
        # The member that stalled with all of version 7: the manager's wait for it ended once its
        # health checks failed (not at its HTTP timeout, weight_update_timeout + 10 s), the other held 7.
        assert faults.fired("weights.member_stalls_in_place")
        assert re.search(rf"weight group {stalled_in_place}: \S+ dropped \(", log), log[-3000:]
        assert not re.search(rf"weight group {stalled_in_place} abandoned", log), log[-3000:]
        assert re.search(r"weight update of \S+ to version 7 skipped: the server left routing", log), log[-3000:]


@pytest.mark.parametrize("protocol", ["realrl", "sglang"])
def test_a_member_that_stalls_is_dropped_and_the_others_take_the_next_version_in_the_same_epoch(
    tmp_path, etcd_server, monkeypatch, protocol
):
    """Three torch servers (`realrl`: their group routes; `sglang`: emulating
    SGLang 0.5.23, over SGLang's routes) take versions, each member in a
    process group of two with the sender (were they one group, gloo's tree
    would feed rank 3 through rank 1, and a member fed through a stalled one
    would wait until the collective's timeout, `weights.timeout_s` = 120 s
    here: SGLang's plain `dist.broadcast` looks at nothing else, and a torch
    member left only with the whole epoch). The sender
    is held for the member at rank 1 of the epoch (the one a tree would relay
    through, whatever order the servers started in) after version 2's first
    bucket (the `weights.bucket_sent.r1` gate, this process being the
    trainer) while that member is stopped (SIGSTOP): up, holding its sockets,
    answering nothing. The two others take version 2 whole through their
    groups and serve it without waiting for anything of the stalled one's.
    Version 3 is published meanwhile: the manager drops the stalled member
    from the epoch (`drop/<rank>`: by the lag rule, it lags its peers in a
    version while a newer one waits, realrl: the sender has not finished
    version 2 to it, SGLang: not in place; or by its failed health checks,
    whichever comes first) instead of abandoning the epoch, the sender stops
    feeding it, and the others take version 3 through the same epoch
    (neither loaded from disk nor a new epoch first) and serve it as the
    trainer's weights answer. Once the stopped one answers again it loads
    version 3 from disk (written on demand) before it takes requests and
    serves the trainer's version 3; an epoch of all three carries version 4."""
    import asyncio
    import time

    import aiohttp

    from realrl.base import faults
    from realrl.impl.generation import make_client
    from tests.impl.weights.test_torch_server_group import forward_logprobs
    from tests.system.trial_thread import wait_until

    fault_dir = _armed(tmp_path, monkeypatch, "weights.bucket_sent.r1=gate;after=test.hold_sender")
    timeout_s = 120.0  # a collective's, and a weight update's: no step of the test may wait it out
    model, weights_dir, trial, publisher, announce = _two_servers_and_a_sender(
        tmp_path, etcd_server, protocol, timeout_s, weight_update_timeout=timeout_s, n_servers=3
    )
    manager_log = trial.launcher.log_path("gserver_manager", 0)
    probe = [5, 6, 7, 8, 9]
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    result: dict = {}

    async def epoch_of_three(other_than: str | None = None) -> list[str]:
        """The members of the current epoch once it has all three servers, in rank order."""
        for _ in range(2400):
            now = _current_epoch(trial)
            found = re.search(rf"weight group {now}: 3 servers \(([^)]*)\)", open(manager_log).read()) if now else None
            if found and now != other_than:
                return found.group(1).split(", ")
            await asyncio.sleep(0.05)
        raise AssertionError(f"no epoch of three servers: {open(manager_log).read()[-3000:]}")

    async def manager_at(manager_url: str, version: int) -> None:
        async with aiohttp.ClientSession(headers=trial_secret.http_headers()) as session:
            await _manager_at(session, manager_url, version)

    def publish(version: int) -> None:
        train_a_little(model, version)
        assert publisher.publish(version, None, announce)

    async def serving(client, url: str, version: int, since: float):
        """`url`'s greedy answer to the probe once it serves `version` (every token: a torch server
        resumes a request a swap interrupted under the new weights), and the seconds since `since`."""
        for _ in range(2400):
            served = await client.generate(url, probe, greedy)
            versions = set(served.output_versions or [served.weight_version])
            if served.finish_reason != "abort" and served.weight_version == str(version) and versions == {str(version)}:
                return served, time.monotonic() - since
            await asyncio.sleep(0.05)
        raise AssertionError(f"{url} did not serve version {version}")

    async def scenario(manager_url: str) -> None:
        members = await epoch_of_three()  # (the servers register in any order: the epoch of all three)
        result["epoch"] = _current_epoch(trial)
        publish(1)
        await manager_at(manager_url, 1)
        (fault_dir / "test.hold_sender").touch()  # the sender stops for rank 1 after version 2's first bucket
        publish(2)
        held = lambda: faults.fired("weights.bucket_sent.r1")  # noqa: E731
        await asyncio.to_thread(wait_until, held, 60, "version 2's first bucket to rank 1")
        stalled = result["stalled"] = members[0]  # rank 1: a tree would feed rank 3 through it
        result["pid"] = _server_pid(trial, stalled, 3)
        os.kill(result["pid"], signal.SIGSTOP)
        stalled_at = time.monotonic()
        faults.open_gate(str(fault_dir), "weights.bucket_sent.r1")
        healthy = result["healthy"] = members[1:]
        async with make_client("sglang", timeout_s=timeout_s + 30) as client:
            result["v2"] = await asyncio.gather(*(serving(client, u, 2, stalled_at) for u in healthy))
            result["v2_trainer"] = [forward_logprobs(model, probe, s.output_ids) for s, _ in result["v2"]]
            publish(3)  # while the stopped member still holds the sender's thread for version 2
            ready = time.monotonic()
            result["v3"] = await asyncio.gather(*(serving(client, u, 3, ready) for u in healthy))
            result["v3_epoch"] = _current_epoch(trial)
            result["v3_trainer"] = [forward_logprobs(model, probe, s.output_ids) for s, _ in result["v3"]]
            await manager_at(manager_url, 3)
            os.kill(result["pid"], signal.SIGCONT)  # it answers again: version 3 from disk, then an epoch of three
            result["pid"] = None
            await epoch_of_three(other_than=result["epoch"])
            back, _ = await serving(client, stalled, 3, time.monotonic())
            result["back"] = back, forward_logprobs(model, probe, back.output_ids)
        publish(4)
        await manager_at(manager_url, 4)
        async with make_client("sglang", timeout_s=60) as client:
            result["held"] = [await client.weight_version(u) for u in members]

    def resume_stopped() -> None:
        _resume(result.get("pid"))
        if faults.fired("weights.bucket_sent.r1"):
            faults.open_gate(str(fault_dir), "weights.bucket_sent.r1")

    _run_scenario(trial, publisher, scenario, on_exit=resume_stopped)
    log = open(manager_log).read()
    print(
        "healthy members serve v2 after the stall, v3 after it was published (s):",
        [[round(after, 2) for _, after in result[v]] for v in ("v2", "v3")],
    )
    stalled = re.escape(result["stalled"])
    for v in ("v2", "v3"):  # each version whole, the trainer's, never part of it swapped in
        for (served, after), trainer in zip(result[v], result[f"{v}_trainer"]):
            assert after < timeout_s / 4, (v, after, log[-3000:])  # (generous: far below the collective's timeout)
            torch.testing.assert_close(torch.tensor(served.output_logprobs), trainer, atol=1e-4, rtol=0)
    # Dropped from the epoch, not abandoned: version 3 went through the same epoch to the two others.
    assert re.search(rf"weight group {result['epoch']}: {stalled} dropped", log), log[-3000:]
    assert not re.search(rf"weight group {result['epoch']} abandoned", log), log[-3000:]
    assert result["v3_epoch"] == result["epoch"]
    assert "updating 2 servers to weight version 3 (broadcast)" in log, log[-3000:]
    for url in result["healthy"]:  # neither lost to the epoch nor loaded from disk
        assert not re.search(rf"{re.escape(url)} (left it|holds a whole version again)", log), log[-3000:]
        assert not re.search(rf"weight group {result['epoch']}: {re.escape(url)} dropped", log), log[-3000:]
    # The stopped one, back: version 3 from disk before it took requests, the trainer's.
    assert re.search(rf"at {stalled} holds weight version \d: loading version 3", log), log[-3000:]
    back, trainer = result["back"]
    torch.testing.assert_close(torch.tensor(back.output_logprobs), trainer, atol=1e-4, rtol=0)
    assert result["held"] == ["4"] * 3
    assert "updating 3 servers to weight version 4 (broadcast)" in log, log[-3000:]


def test_an_sglang_member_that_dies_between_an_announcement_and_its_first_bucket_is_dropped(
    tmp_path, etcd_server, monkeypatch
):
    """Two torch servers emulating SGLang 0.5.23. Version 2 is announced and
    one member dies before any of its buckets (SIGKILL at the
    `weights.before_first_bucket` fault point, as its `/begin_weight_update`
    begins: paused, nothing of version 2 in place), the sender already in
    that member's collective or about to be. The manager drops it from the
    epoch (its calls fail) and the sender leaves its group (its connections
    closed): the other member takes version 2 through its own group in the
    same epoch, not by disk, and no epoch is abandoned. The killed one,
    restarted, loads version 2 from disk (written on demand) before it takes
    requests, and an epoch of both carries version 3 to both, which answer
    as the trainer's weights do."""
    import asyncio

    import aiohttp

    from realrl.base import faults
    from realrl.impl.generation import make_client
    from tests.impl.weights.test_torch_server_group import forward_logprobs
    from tests.system.test_generation_server import EXP

    fault_dir = _armed(tmp_path, monkeypatch, "weights.before_first_bucket=kill;after=test.kill_member")
    timeout_s = 120.0  # a collective's, and a weight update's: no step of the test may wait it out
    model, weights_dir, trial, publisher, announce = _two_servers_and_a_sender(
        tmp_path, etcd_server, "sglang", timeout_s, weight_update_timeout=timeout_s
    )
    manager_log = trial.launcher.log_path("gserver_manager", 0)
    probe = [5, 6, 7, 8, 9]
    result: dict = {}

    async def publish(session, manager_url: str, version: int) -> None:
        await _publish_and_wait(session, manager_url, model, publisher, announce, version)

    async def scenario(manager_url: str) -> None:
        async with aiohttp.ClientSession(headers=trial_secret.http_headers()) as session:
            await publish(session, manager_url, 1)  # through the first epoch
            result["epoch"] = _current_epoch(trial)
            (fault_dir / "test.kill_member").touch()  # a member dies as version 2 is announced to it
            await publish(session, manager_url, 2)
            for _ in range(2400):  # the killed one, restarted (at a new url), in an epoch of both
                urls = [trial.get(names.gen_server(EXP, trial.trial, i)) for i in range(2)]
                now, log = _current_epoch(trial), open(manager_log).read()
                if now != result["epoch"] and all(u and u in log for u in urls):
                    if re.search(rf"weight group {now}: 2 servers", log):
                        break
                await asyncio.sleep(0.05)
            await publish(session, manager_url, 3)
        urls = [trial.get(names.gen_server(EXP, trial.trial, i)) for i in range(2)]
        async with make_client("sglang", timeout_s=60) as client:
            result["held"] = [await client.weight_version(u) for u in urls]
            greedy = {"max_new_tokens": 8, "temperature": 0.0}
            result["outs"] = [await client.generate(u, probe, greedy) for u in urls]

    _run_scenario(trial, publisher, scenario)
    log = open(manager_log).read()
    assert faults.fired("weights.before_first_bucket")
    epoch = result["epoch"]
    assert re.search(rf"weight group {epoch}: \S+ dropped \(version 2: ", log), log[-3000:]
    assert not re.search(rf"weight group {epoch} abandoned", log), log[-3000:]
    assert re.search(r"updating \d servers to weight version 2 \(broadcast\)", log), log[-3000:]
    assert re.search(r"holds weight version \d: loading version 2 before it takes requests", log), log[-3000:]
    assert "updating 2 servers to weight version 3 (broadcast)" in log, log[-3000:]
    assert result["held"] == ["3", "3"]
    outs = result["outs"]
    assert outs[0].output_ids == outs[1].output_ids and outs[0].output_logprobs == outs[1].output_logprobs
    torch.testing.assert_close(
        torch.tensor(outs[0].output_logprobs), forward_logprobs(model, probe, outs[0].output_ids), atol=1e-4, rtol=0
    )


def test_an_sglang_member_that_stalls_mid_version_does_not_hold_the_other_back(tmp_path, etcd_server, monkeypatch):
    """Two torch servers emulating SGLang 0.5.23 take versions over SGLang's
    routes (`weights.transport=broadcast`; real manager and server workers,
    this process is the trainer). One member stops (SIGSTOP, the
    `weights.member_stalls` fault point) right after it received one of
    version 2's buckets, inside its `/update_weights_from_distributed`: up,
    holding its sockets, answering nothing. The other member takes version 2
    whole through its own group at its own pace (it is asked for each bucket
    once the sender finished the one before to it), never waiting for the
    stalled one, and serves it within seconds, not at the collective's
    timeout (`weights.timeout_s` = `weight_update_timeout` = 120 s), nor
    after the stalled one's health checks, nor loaded again from disk once
    they fail and the epoch is abandoned (the sender leaves the stalled
    one's collective then). Once the stalled one answers again it loads
    version 2 from disk before it takes requests, and a new epoch of both
    carries version 3 to both."""
    import asyncio
    import time

    import aiohttp

    from realrl.base import faults
    from realrl.impl.generation import make_client
    from tests.impl.weights.test_torch_server_group import forward_logprobs
    from tests.system.test_generation_server import EXP

    fault_dir = _armed(tmp_path, monkeypatch, "weights.member_stalls=stop;after=test.stall_server")
    timeout_s = 120.0  # a collective's, and a weight update's: no step of the test may wait it out
    model, weights_dir, trial, publisher, announce = _two_servers_and_a_sender(
        tmp_path, etcd_server, "sglang", timeout_s, weight_update_timeout=timeout_s
    )
    manager_log = trial.launcher.log_path("gserver_manager", 0)
    probe = [5, 6, 7, 8, 9]
    greedy = {"max_new_tokens": 8, "temperature": 0.0}

    async def publish(session, manager_url: str, version: int) -> None:
        await _publish_and_wait(session, manager_url, model, publisher, announce, version)

    result: dict = {}

    async def scenario(manager_url: str) -> None:
        urls = [trial.get(names.gen_server(EXP, trial.trial, i)) for i in range(2)]
        async with aiohttp.ClientSession(headers=trial_secret.http_headers()) as session:
            await publish(session, manager_url, 1)  # through the first epoch
            result["epoch"] = _current_epoch(trial)
            (fault_dir / "test.stall_server").touch()  # a member stops in one of version 2's buckets
            train_a_little(model, 2)
            assert publisher.publish(2, None, announce)
            wait_pid = lambda: faults.stopped_pid(str(fault_dir), "weights.member_stalls")  # noqa: E731
            await asyncio.to_thread(wait_until, wait_pid, 60, "a member stalling in version 2")
            stalled_at = float((fault_dir / "weights.member_stalls").read_text())
            # (the one the fault point stopped, by its pid: not by a health probe's timing on a loaded machine)
            stalled = next(u for u in urls if _server_pid(trial, u, 2) == wait_pid())
            healthy = next(u for u in urls if u != stalled)
            result["healthy"] = healthy
            # The healthy member, paused for version 2: it serves again once version 2 is in place.
            async with make_client("sglang", timeout_s=timeout_s + 30) as client:
                served = await client.generate(healthy, probe, greedy)
                while served.finish_reason == "abort":  # (sent before its pause for version 2 came)
                    served = await client.generate(healthy, probe, greedy)
            result["served_after"] = time.time() - stalled_at
            result["served"] = served
            result["v2"] = forward_logprobs(model, probe, served.output_ids)
            for _ in range(1200):  # the manager holds version 2 (the stalled server out of routing)
                async with session.get(manager_url + "/get_model_version") as resp:
                    if (await resp.json())["version"] == 2:
                        break
                await asyncio.sleep(0.05)
            os.kill(wait_pid(), signal.SIGCONT)  # the stalled one answers again: back by disk, then an epoch of both
            for _ in range(1200):
                log = open(manager_log).read()
                if (now := _current_epoch(trial)) != result["epoch"] and re.search(
                    rf"weight group {now}: 2 servers", log
                ):
                    break
                await asyncio.sleep(0.05)
            await publish(session, manager_url, 3)
        async with make_client("sglang", timeout_s=60) as client:
            result["held"] = [await client.weight_version(u) for u in (healthy, stalled)]
            result["outs"] = [await client.generate(u, probe, greedy) for u in (healthy, stalled)]
        result["stalled"] = stalled

    _run_scenario(
        trial, publisher, scenario, on_exit=lambda: _resume(faults.stopped_pid(str(fault_dir), "weights.member_stalls"))
    )
    log = open(manager_log).read()
    # The healthy member served again within seconds of the stall, far below the collective's timeout,
    # and with version 2 whole (through its group), never a model with part of version 2 swapped in.
    assert result["served_after"] < timeout_s / 4, (result["served_after"], log[-3000:])
    served = result["served"]
    assert served.weight_version == "2", served
    torch.testing.assert_close(torch.tensor(served.output_logprobs), result["v2"], atol=1e-4, rtol=0)
    # Dropped from the epoch once found down (the other went on in it), not the epoch abandoned.
    assert re.search(rf"weight group {result['epoch']}: {re.escape(result['stalled'])} dropped", log), log[-3000:]
    assert not re.search(rf"weight group {result['epoch']} abandoned", log), log[-3000:]
    healthy = re.escape(result["healthy"])  # (neither lost to the epoch nor loaded from disk)
    assert not re.search(rf"{healthy} (left it|holds a whole version again)", log), log[-3000:]
    # The stalled one, back: version 2 from disk before it took requests, then version 3 through a new epoch.
    assert re.search(rf"at {re.escape(result['stalled'])} holds weight version 1: loading version 2", log), log[-3000:]
    assert "updating 2 servers to weight version 3 (broadcast)" in log, log[-3000:]
    assert result["held"] == ["3", "3"]
    outs = result["outs"]
    assert outs[0].output_ids == outs[1].output_ids and outs[0].output_logprobs == outs[1].output_logprobs
    torch.testing.assert_close(
        torch.tensor(outs[0].output_logprobs), forward_logprobs(model, probe, outs[0].output_ids), atol=1e-4, rtol=0
    )


def test_a_version_no_server_can_load_is_written_on_demand_also_with_every_server_gone(tmp_path, etcd_server):
    """While every server is a member, a version goes through the group and
    is never written to disk. A member killed between versions (the trainer
    idle, as one waiting for a batch) restarts, finds no directory of the
    current version, and the manager has the trainer write it (from the
    snapshot its sender keeps): the server serves it, as the trainer's
    weights do. Then both servers are killed at once: no server, so no batch
    and no next version; both restart and get the current version the same
    way (no deadlock). An epoch of both then carries the next version over
    the wire, again not written; the newest directory written stays."""
    import asyncio

    import aiohttp
    import psutil

    from realrl.impl.generation import make_client
    from tests.impl.weights.test_torch_server_group import forward_logprobs
    from tests.system.test_generation_server import EXP

    model, weights_dir, trial, publisher, announce = _two_servers_and_a_sender(tmp_path, etcd_server, "realrl", 600.0)
    manager_log = trial.launcher.log_path("gserver_manager", 0)
    probe, greedy = [5, 6, 7, 8, 9], {"max_new_tokens": 8, "temperature": 0.0}

    def on_disk() -> list[int]:
        return sorted(int(d) for d in os.listdir(weights_dir) if d.isdigit()) if os.path.isdir(weights_dir) else []

    def urls() -> list[str]:
        return [trial.get(names.gen_server(EXP, trial.trial, i)) for i in range(2)]

    def kill_servers(which: list[str]) -> None:
        ports = {u.rsplit(":", 1)[1] for u in which}
        for pid in trial.launcher.worker_pids:
            for child in psutil.Process(pid).children(recursive=True):
                if any(a in ports for a in child.cmdline()) and "torch_server" in " ".join(child.cmdline()):
                    child.kill()

    async def manager(session, manager_url: str, route: str) -> dict:
        async with session.get(manager_url + route) as resp:
            return await resp.json()

    async def both_up_again(session, manager_url: str, before: list[str], version: int) -> list[str]:
        """Both servers (the killed ones at new urls) up in the manager's routing at `version`."""
        for _ in range(2400):
            servers = (await manager(session, manager_url, "/servers"))["servers"]
            up = {s["url"]: s for s in servers if s["state"] == "up"}
            now = urls()
            if all(u in up and up[u]["version"] == version for u in now) and now != before:
                return now
            await asyncio.sleep(0.05)
        raise AssertionError(f"the servers did not come back at version {version}")

    async def epoch_of(now: list[str]) -> None:
        for _ in range(2400):
            groups = re.findall(r"weight group \S+: 2 servers \(([^)]*)\)", open(manager_log).read())
            if any(set(g.split(", ")) == set(now) for g in groups):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no epoch of {now}")

    async def publish(session, manager_url: str, version: int) -> None:
        await _publish_and_wait(session, manager_url, model, publisher, announce, version)

    async def served(now: list[str]) -> list:
        async with make_client("sglang", timeout_s=60) as client:
            return [await client.generate(u, probe, greedy) for u in now]

    result: dict = {}

    async def scenario(manager_url: str) -> None:
        async with aiohttp.ClientSession(headers=trial_secret.http_headers()) as session:
            first = urls()
            await epoch_of(first)
            await publish(session, manager_url, 1)
            result["after_1"] = on_disk()
            kill_servers(first[:1])  # a member gone between versions: version 1 was never written
            second = await both_up_again(session, manager_url, first, 1)
            outs = await served(second)
            result["one_back"] = (on_disk(), outs, [forward_logprobs(model, probe, o.output_ids) for o in outs])
            await epoch_of(second)
            await publish(session, manager_url, 2)
            result["after_2"] = on_disk()
            kill_servers(second)  # every server gone: no batch, no next version
            third = await both_up_again(session, manager_url, second, 2)
            result["all_back"] = (on_disk(), await served(third))
            result["v2"] = [forward_logprobs(model, probe, o.output_ids) for o in result["all_back"][1]]
            await epoch_of(third)
            await publish(session, manager_url, 3)
            for _ in range(200):  # (the manager deletes older directories once every server holds 3)
                if "all servers hold weight version 3" in open(manager_log).read() and on_disk() == [2]:
                    break
                await asyncio.sleep(0.05)
            result["after_3"] = on_disk()
            result["v3_outs"] = await served(third)
            result["v3"] = [forward_logprobs(model, probe, o.output_ids) for o in result["v3_outs"]]

    _run_scenario(trial, publisher, scenario)
    log = open(manager_log).read()
    assert result["after_1"] == [], result  # through the group, every server a member: not written
    assert result["one_back"][0] == [1], result  # written once the restarted member needed it
    assert "weight version 1 is not on disk: the trainer is asked to write it" in log, log[-3000:]
    for out, expected in zip(result["one_back"][1], result["one_back"][2]):
        assert out.weight_version == "1"
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=1e-4, rtol=0)
    assert result["after_2"] == [1], result
    held, outs = result["all_back"]
    assert held == [1, 2], result  # written for the servers that all came back
    assert "weight version 2 is not on disk: the trainer is asked to write it" in log, log[-3000:]
    assert [o.weight_version for o in outs] == ["2", "2"]
    for out, expected in zip(outs, result["v2"]):
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=1e-4, rtol=0)
    assert "updating 2 servers to weight version 3 (broadcast)" in log, log[-3000:]
    assert result["after_3"] == [2], result  # version 3 not written; the newest written (2) kept
    assert [o.weight_version for o in result["v3_outs"]] == ["3", "3"]
    for out, expected in zip(result["v3_outs"], result["v3"]):
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=1e-4, rtol=0)


def _server_pid(trial, url: str, n_servers: int) -> int:
    """The pid of the torch server at `url` (its worker logs it once healthy)."""
    for i in range(n_servers):
        log = open(trial.launcher.log_path("generation_server", i)).read()
        if found := re.search(rf"server pid (\d+) healthy at {re.escape(url)}\b", log):
            return int(found.group(1))
    raise AssertionError(f"no server pid for {url}")


def _current_epoch(trial) -> str | None:
    """The name of the trial's current weight epoch (None before its first)."""
    from tests.system.test_generation_server import EXP

    spec = trial.get(names.weights_group(EXP, trial.trial, "actor"))
    return json.loads(spec)["name"] if spec else None


async def _publish_and_wait(session, manager_url: str, model, publisher, announce, version: int) -> None:
    """Trains a little, publishes `version` and waits until the manager is at it."""

    train_a_little(model, version)
    assert publisher.publish(version, None, announce)
    await _manager_at(session, manager_url, version)


async def _manager_at(session, manager_url: str, version: int) -> None:
    """Waits until the manager at `manager_url` is at `version` (60 s at most)."""
    import asyncio

    for _ in range(1200):
        async with session.get(manager_url + "/get_model_version") as resp:
            if (await resp.json())["version"] == version:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the manager did not reach version {version}")


def _run_scenario(trial, publisher, scenario, on_exit=lambda: None):
    """Runs `scenario(manager_url)` once the manager named the first epoch,
    then ends the trial; `on_exit` runs first either way (a failed test must
    not leave a member stopped). Returns what the scenario returned."""
    import asyncio

    from tests.system.test_generation_server import EXP

    try:
        wait_until(lambda: trial.get(names.weights_group(EXP, trial.trial, "actor")), 120, "the first epoch")
        out = asyncio.run(scenario(trial.wait_key(names.gen_server_manager(EXP, trial.trial))))
        publisher.close()
        assert trial.complete() == 0
        return out
    finally:
        on_exit()
        publisher.close(timeout_s=1)
        trial.close()


def _resume(pid: int | None) -> None:
    """SIGCONT to a member a fault point stopped, if any (and still there)."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _armed(tmp_path, monkeypatch, armed: str):
    """Arms the fault points `armed` for the workers this test starts; their
    directory (where a test's `after=` files go) is returned."""
    from realrl.base import faults

    monkeypatch.setenv(faults.FAULTS_ENV, armed)
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()
    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(fault_dir))
    return fault_dir


def _two_servers_and_a_sender(
    tmp_path, etcd_server, protocol: str, timeout_s: float, weight_update_timeout=None, n_servers: int = 2
):
    """A trial of two (`n_servers`) torch servers (`sglang`: emulating SGLang 0.5.23) and the
    manager, `weights.transport=broadcast`, training started; this process is
    the trainer: (model, weights_dir, trial, publisher, announce)."""
    from realrl.api.system_api import GserverManagerConfig
    from realrl.launcher.local import WorkerGroup
    from tests.system.test_generation_server import EXP, build_tiny_model, server_config
    from tests.system.trial_thread import TrialThread

    _, model = build_tiny_model(seed=1)
    model_dir = publish_weights(model, str(tmp_path / "model"), 0)
    weights_dir = str(tmp_path / "weights")
    wire = WeightTransportConfig(transport="broadcast", bucket_bytes=16384, timeout_s=timeout_s, protocol=protocol)
    manager_cfg = GserverManagerConfig(
        n_servers=n_servers, train_batch_size=2, weights_dir=weights_dir, poll_interval=0.05, weights=wire
    )
    if weight_update_timeout is not None:
        manager_cfg.weight_update_timeout = weight_update_timeout
    # (a stalled server is found by its health checks: 2 unanswered within 2 s each)
    manager_cfg.health_check_interval, manager_cfg.health_check_timeout, manager_cfg.health_check_failures = 0.5, 2, 2
    servers = server_config(model_dir, "sglang" if protocol == "sglang" else "torch")
    if protocol == "sglang":
        servers.torch.emulate_sglang, servers.torch.emulate_sglang_dp = "0.5.23", 1
    groups = [WorkerGroup("generation_server", n_servers, servers), WorkerGroup("gserver_manager", 1, manager_cfg)]
    trial = TrialThread(tmp_path, etcd_server.addr, groups, EXP).start()
    trial.start_training()
    publisher = BroadcastPublisher(
        wire,
        model,
        None,
        lambda v, state: publish_weights(model, weights_dir, v, state_dict=state),
        EXP,
        trial.trial,
        HOST,
    )
    announce = lambda v: trial.set(names.model_version(EXP, trial.trial, "actor"), str(v))  # noqa: E731
    return model, weights_dir, trial, publisher, announce
