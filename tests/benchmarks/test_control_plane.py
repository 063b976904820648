"""A tiny run of the control-plane benchmark (benchmarks/control_plane.py):
a whole trial with the real launcher, master, manager and rollout workers
around 4 simulated servers, measured for a few seconds with each routing;
the JSON and the plot it writes, and nothing of the trial left behind."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

from benchmarks.control_plane import during_updates, main, published_versions, update_windows
from benchmarks.sim.agent import direct_call
from realrl.impl.generation.client import GenerationClient
from realrl.impl.generation.sim_server import SimServerConfig, SimServerHost


def test_a_small_simulated_cluster_is_measured(tmp_path):
    root, out, png = tmp_path / "root", tmp_path / "cp.json", tmp_path / "cp.png"
    args = ["--servers", "4", "--episodes", "32", "--rate", "40", "--version-interval", "1", "--rollout-workers", "1"]
    args += [
        "--window",
        "3",
        "--settle",
        "0.5",
        "--grace",
        "1.5",
        "--root",
        str(root),
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    rows = {row["routing"]: row for row in result["rows"]}
    assert sorted(rows) == ["client", "manager"]
    for row in rows.values():
        assert (row["servers"], row["episodes"]) == (4, 32) and 0 < row["episodes_running"] <= 32
        # Calls went through the runtime and straight to the servers; both were timed.
        assert row["calls_measured"] > 0 and row["direct_calls_measured"] > 0 and row["requests_per_s"] > 0
        assert row["added_p50_ms"] is not None and row["added_p99_ms"] is not None
        # Each call counts by its time outside the servers: they reported their own time (server_s).
        assert 0 <= row["steady_share"] <= 1 and "added_steady_p99_ms" in row
        assert 0 < row["outside_p50_ms"] < row["via_p50_ms"] and 0 < row["direct_outside_p50_ms"] < row["direct_p50_ms"]
        # Versions were published in the window and reached all 4 servers (each read the files).
        assert row["versions"] >= 1 and row["version_fanout_s"] is not None and row["version_fanout_s"] >= 0
        assert row["etcd_keys"] > 0 and row["etcd_ops_per_s"] > 0
        assert row["cpu_cores"]["manager"] > 0 and row["rss_mb"]["manager"] > 0
    # Routed in the rollout workers, a generation call costs the manager no request of its own.
    assert rows["client"]["manager_requests_per_call"] < 1 < rows["manager"]["manager_requests_per_call"]
    (comparison,) = result["comparison"]
    assert comparison["manager_over_client"]["requests_per_s"] > 1
    assert png.stat().st_size > 0
    assert sorted(os.listdir(root)) == ["logs", "model", "prompts.jsonl", "run"]  # the trial's own files are gone
    assert os.listdir(root / "logs" / "control-plane") == []


def test_calls_are_told_apart_by_the_weight_updates_they_overlap(tmp_path):
    (tmp_path / "sim").mkdir()
    # Version 2 was skipped for 3 (no server loaded it); 4 was still going out at the end.
    published = [[1, 100.0], [2, 103.0], [3, 104.0], [4, 109.0]]
    (tmp_path / "sim" / "trainer.json").write_text(json.dumps({"published": published}))
    loads = {1: {"servers": 8, "last": 100.5}, 3: {"servers": 8, "last": 104.8}}
    windows = update_windows(published_versions(str(tmp_path)), loads, grace_s=5.0)
    assert windows == [(100.0, 100.5), (103.0, 104.0), (104.0, 104.8), (109.0, 114.0)]
    starts = np.array([99.0, 100.2, 101.0, 102.5, 104.9, 108.0])
    ends = np.array([99.9, 100.9, 102.0, 103.1, 105.5, 108.9])
    assert during_updates(starts, ends, windows).tolist() == [False, True, False, True, False, False]


def test_a_direct_call_that_an_update_interrupts_is_sent_again_to_its_server(tmp_path):
    """The baseline's direct call resubmits what a weight update interrupted, to the same
    server, as a plain client would: the answer is complete (all its tokens) and the servers'
    time of both requests is counted."""
    weights = tmp_path / "v1"
    weights.mkdir()
    save_file({"w": torch.zeros(4)}, str(weights / "model.safetensors"))

    async def go():
        config = SimServerConfig(token_latency_s=0.02, output_tokens=20, vocab_size=64, eos_token_ids=[1])
        host = SimServerHost(config)
        try:
            (url,) = await host.start(1)
            async with GenerationClient(timeout_s=60) as client:
                plain = await direct_call(client, url, [0, 5], {"max_new_tokens": 20, "temperature": 1.0})
                assert plain[1] is False and 0.39 <= plain[0] < 5.0  # 20 tokens at 20 ms at least
                call = asyncio.create_task(direct_call(client, url, [0, 5], {"max_new_tokens": 20, "temperature": 1.0}))
                while host.engines[0].info().num_running_requests == 0:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(0.1)  # a few tokens in
                await client.update_weights_from_disk(url, str(weights), 1)
                server_s, interrupted = await call
                # Both requests' time: 20 tokens in all (the resubmitted one alone is ~15).
                assert interrupted and 0.39 <= server_s < 5.0
                engine = host.stats()["engine"]
                assert engine["finish_abort"] == 1 and engine["generated_tokens"] == 40  # 20 + 20: none lost
        finally:
            await host.close()

    asyncio.run(go())
