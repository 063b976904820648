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
    "overrides, key",
    [
        ("ppo.group_size=0", "ppo.group_size"),
        ("rollout.max_head_offpolicyness=-1", "rollout.max_head_offpolicyness"),
        ("allocation_mode=gen:x", "allocation_mode"),
        ("nosuchkey=1", "nosuchkey"),
        ("ppo.no_such_field=1", "ppo.no_such_field"),
        ("mode=slurm slurm.nodes=0", "slurm.nodes"),
        ("model.path=/nonexistent/model", "model.path"),
        # agent / environment types, against the registries after loading the plugins
        ("rollout.agent.type=nosuch", "rollout.agent.type"),
        ("rollout.env.type=nosuch", "rollout.env.type"),
        (
            "plugins=[{repo}/tests/e2e/shard_filter_plugin.py] rollout.agent.type=shard-filter-agnet",
            "rollout.agent.type",
        ),
        # a reward function: missing file, missing function, broken file, unknown name, clash with an env
        ("rollout.reward_fn={tmp}/nonexistent.py:reward", "rollout.reward_fn"),
        ("rollout.reward_fn={tmp}/reward.py:no_such_fn", "rollout.reward_fn"),
        ("rollout.reward_fn={tmp}/broken_plugin.py:reward", "rollout.reward_fn"),
        ("rollout.reward_fn=no_such_registered_reward", "rollout.reward_fn"),
        ("rollout.reward_fn={tmp}/reward.py:reward rollout.env.type=nosuch", "rollout.reward_fn"),
        ("rollout.reward_fn_timeout=0", "rollout.reward_fn_timeout"),
        # the agent's and environment's own arguments, against their signatures (no `+` needed)
        ("rollout.agent.args.no_such_arg=1", "rollout.agent.args"),
        ("rollout.agent.type=math-multi-turn rollout.agent.args.num_turn=3", "rollout.agent.args"),
        ("rollout.env.args.no_such_arg=1", "rollout.env.args"),
        ("plugins=[/nonexistent.py]", "plugins"),
        ("plugins=[{tmp}/broken_plugin.py]", "plugins"),
        ("plugins=[no_such_module_xyz]", "plugins"),
        # evaluation
        ("eval.batch_size=0", "eval.batch_size"),
        ("eval.batch_size=-4", "eval.batch_size"),
        ("eval.max_new_tokens=-1", "eval.max_new_tokens"),
        ("eval.max_prompts=-1", "eval.max_prompts"),
        # generation lengths against the model's positions (the tiny model has 256)
        ("rollout.gconfig.max_new_tokens=256", "rollout.gconfig.max_new_tokens"),
        ("eval.max_new_tokens=1000", "eval.max_new_tokens"),
        (
            "model.path={tmp}/model dataset.train_path={tmp}/train.jsonl rollout.gconfig.max_new_tokens=64",
            "rollout.gconfig.max_new_tokens",
        ),
        # servers and requests
        ("server.torch.max_running_requests=0", "server.torch.max_running_requests"),
        ("server.torch.dtype=int8", "server.torch.dtype"),
        ("server.torch.emulate_sglang=0.4.8", "server.torch.emulate_sglang"),
        ("server.startup_timeout=0", "server.startup_timeout"),
        ("server.weight_update_timeout=-1", "server.weight_update_timeout"),
        ("server.weight_update_retries=-1", "server.weight_update_retries"),
        ("server.sglang.mem_fraction_static=0", "server.sglang.mem_fraction_static"),
        ("server.sglang.mem_fraction_static=1.5", "server.sglang.mem_fraction_static"),
        ("rollout.request_retries=-1", "rollout.request_retries"),
        ("rollout.request_timeout=0", "rollout.request_timeout"),
        # optimizer
        ("optimizer.warmup_steps=-1", "optimizer.warmup_steps"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
        ("optimizer.beta1=1.0", "optimizer.beta1"),
        ("optimizer.beta2=-0.1", "optimizer.beta2"),
        ("optimizer.eps=0", "optimizer.eps"),
        # where files go: checked without creating anything
        ("fileroot=/proc/x", "fileroot"),
        ("fileroot={tmp}/a_file/runs", "fileroot"),
        ("fileroot={tmp}/a_file", "fileroot"),
        ("tiny_kit.cache_dir={tmp}/a_file/cache", "tiny_kit.cache_dir"),
        # LoRA: a target module the model does not have
        ("model.lora.rank=8 model.lora.target_modules=[qkv_proj]", "model.lora.target_modules"),
    ],
)
def test_bad_config_is_one_line_naming_the_key_and_starts_nothing(tmp_path, overrides, key):
    (tmp_path / "a_file").write_text("a regular file, not a directory\n")
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('this plugin fails on import')\n")
    (tmp_path / "reward.py").write_text("def reward(prompt, completion, answer, **row):\n    return 1.0\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    (tmp_path / "train.jsonl").write_text(json.dumps({"query_id": "q0", "prompt": "1+1=", "answer": "2"}) + "\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    fileroot = tmp_path / "runs"
    args = [o.format(tmp=tmp_path, repo=REPO) for o in overrides.split()]
    proc = subprocess.run(
        [sys.executable, "training/main_async_ppo.py", f"fileroot={fileroot}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("realrl: config error: "), proc.stderr
    # the message starts with the key (Hydra words an unknown top-level key its own way)
    assert lines[0].startswith(f"realrl: config error: {key}: ") or f"Key {key!r} not in" in lines[0], lines[0]
    assert proc.stdout == ""
    assert not fileroot.exists()  # no kit, no logs, no etcd data: nothing started
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nor anything else (cache, probes)


def test_run_script_trains_and_ends_with_the_summary_path(tmp_path, kit_cache):
    """Also what a run shows (docs/observability.md): its output is redirected
    (pipes), so plain lines for the first, every N-th and the last step, no
    carriage return; the idle-ratio and throughput stats; the plots."""
    steps = 4
    proc = subprocess.run(
        [
            "bash",
            "examples/run_async_ppo.sh",
            f"fileroot={tmp_path}",
            f"tiny_kit.cache_dir={kit_cache}",
            f"total_train_steps={steps}",
            "eval.every_n_steps=0",
            "heartbeat_ttl=3",
            "console.every_n_steps=3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("summary: "), proc.stdout[-2000:]
    with open(lines[-1][len("summary: ") :]) as f:
        summary = json.load(f)
    assert summary["steps"] == steps and summary["trajectories"]["consumed"] == steps * 16
    assert summary["initial_eval_accuracy"] is not None and summary["final_eval_accuracy"] is not None

    # The console: no carriage return anywhere, and one plain line for steps 1, 3 (every 3rd) and 4 (the last).
    assert "\r" not in proc.stdout and "\r" not in proc.stderr
    step_lines = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in step_lines] == ["1/4", "3/4", "4/4"], proc.stdout[-3000:]
    assert " acc " in step_lines[-1] and " reward " in step_lines[-1] and "steps/s" in step_lines[-1]
    assert "realrl.steps" not in proc.stdout  # the per-step log lines stay in the log file ...
    log_dir = os.path.dirname(lines[-1][len("summary: ") :])
    assert open(os.path.join(log_dir, "master_worker-0.log")).read().count(" realrl.steps: step ") == steps  # ... here

    # Idle ratios and throughput, every step.
    with open(summary["stats_path"]) as f:
        stats = [json.loads(line) for line in f]
    train = [s for s in stats if "train/actor_loss" in s]
    assert len(train) == steps
    for s in train:
        assert 0 <= s["perf/trainer_idle_ratio"] <= 1 and 0 <= s["perf/gen_idle_ratio"] <= 1, s
        assert s["perf/train_tokens_per_s"] > 0 and s["perf/gen_tokens_per_s"] >= 0, s
        assert 0 <= s["time/wait_data_s"] <= s["time/fetch_s"] and 0 <= s["time/publish_s"] <= s["time/train_s"], s
        # every generated token of the batch (16 trajectories of 8 answers) has a staleness
        assert sum(s["staleness/token_histogram"].values()) == pytest.approx(s["rollout/gen_len/mean"] * 16 * 8), s
    assert sum(s["perf/gen_tokens_per_s"] for s in train) > 0

    # The plots: named on the console and in the summary, each a PNG with data.
    plots = os.path.join(log_dir, "plots")
    assert summary["plots_dir"] == plots and lines[-2] == f"plots: {plots}", lines[-3:]
    from tests.base.test_observability import assert_png_has_data

    names = sorted(os.listdir(plots))
    assert names == [
        "accuracy_reward.png",
        "idle_ratios.png",
        "off_policy.png",
        "staleness.png",
        "step_time.png",
        "throughput.png",
    ]
    for name in names:
        assert_png_has_data(os.path.join(plots, name))
