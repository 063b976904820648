"""benchmarks/algorithms.py's summary: the table and the ratio to GRPO, on
hand-made trial results (the trials themselves are whole realrl runs: the
e2e tests cover those)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.algorithms import best_over_grpo, markdown


def trial(preset: str, seed: int, accs: dict[str, float], task: str = "arithmetic") -> dict:
    return {
        "task": task,
        "preset": preset,
        "seed": seed,
        "exit_code": 0,
        "eval_accuracy": accs,
        "rollout_accuracy_last_quarter": 0.4,
        "behav_ess_min": 0.97 + seed / 100,
        "clip_high_frac": 0.01,
        "clip_low_frac": 0.02,
        "step_s_total": 30.0,
    }


def test_table_means_over_seeds_and_ratio_to_grpo():
    results = [
        trial("grpo", 1, {"0": 0.2, "10": 0.3, "20": 0.4}),
        trial("grpo", 2, {"0": 0.2, "10": 0.3, "20": 0.2}),  # grpo ends at mean 0.3
        trial("dapo", 1, {"0": 0.2, "10": 0.4, "20": 0.45}),
        {"task": "arithmetic", "preset": "gspo", "seed": 1, "exit_code": 1},
    ]
    # dapo's 0.45 over grpo's mean 0.3
    assert best_over_grpo(results, "arithmetic") == pytest.approx(1.5)
    table = markdown(results).splitlines()
    assert table[2] == "| arithmetic | dapo | 0.200 → 0.400 → 0.450 | 0.400 | 0.980 | 0.010 / 0.020 | 30 | 1 |"
    # with several seeds, their range at the end
    grpo = "| arithmetic | grpo | 0.200 → 0.300 → 0.300 (0.200–0.400) | 0.400 | 0.980 | 0.010 / 0.020 | 30 | 2 |"
    assert table[3] == grpo
    assert table[4] == "| arithmetic | gspo | failed | | | | | |"
    assert best_over_grpo(results[2:], "arithmetic") is None  # no grpo trial


def test_the_table_of_earlier_runs_together(tmp_path, capsys, monkeypatch):
    """`--from-json` merges the trials of several runs (more seeds run later) into one table."""
    from benchmarks.algorithms import main

    runs = [[trial("grpo", 1, {"0": 0.2, "20": 0.4})], [trial("grpo", 2, {"0": 0.2, "20": 0.2})]]
    paths = []
    for k, trials in enumerate(runs):
        paths.append(str(tmp_path / f"run{k}.json"))
        with open(paths[-1], "w") as f:
            json.dump({"trials": trials}, f)
    monkeypatch.setattr(sys, "argv", ["algorithms.py", "--from-json", ",".join(paths)])
    assert main() == 0
    assert "| arithmetic | grpo | 0.200 → 0.300 → 0.300 (0.200–0.400) |" in capsys.readouterr().out
