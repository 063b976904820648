"""The user's commands themselves, as subprocesses: `training/main_async_ppo.py`
rejects a bad config in one line naming the key before anything starts, and
`examples/run_async_ppo.sh` runs a trial and ends with `summary: <path>`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "override, key",
    [
        ("ppo.group_size=0", "ppo.group_size"),
        ("rollout.max_head_offpolicyness=-1", "rollout.max_head_offpolicyness"),
        ("allocation_mode=gen:x", "allocation_mode"),
        ("nosuchkey=1", "nosuchkey"),
        ("ppo.no_such_field=1", "ppo.no_such_field"),
        ("mode=ray", "mode"),
        ("model.path=/nonexistent/model", "model.path"),
    ],
)
def test_bad_config_is_one_line_naming_the_key_and_starts_nothing(tmp_path, override, key):
    fileroot = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "training/main_async_ppo.py", f"fileroot={fileroot}", override],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("realrl: config error: "), proc.stderr
    assert key.rsplit(".", 1)[-1] in lines[0], lines[0]
    assert proc.stdout == ""
    assert not fileroot.exists()  # no kit, no logs, no etcd data: nothing started


def test_run_script_trains_and_ends_with_the_summary_path(tmp_path, kit_cache):
    proc = subprocess.run(
        ["bash", "examples/run_async_ppo.sh", f"fileroot={tmp_path}", f"tiny_kit.cache_dir={kit_cache}",
         "total_train_steps=2", "eval.every_n_steps=0", "heartbeat_ttl=3"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: "), proc.stdout[-2000:]
    with open(last[len("summary: ") :]) as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["trajectories"]["consumed"] == 2 * 16
    assert summary["initial_eval_accuracy"] is not None and summary["final_eval_accuracy"] is not None
