"""benchmarks/algorithms.py's summary: the table and the ratio to GRPO, on
hand-made trial results (the trials themselves are whole realrl runs: the
e2e tests cover those)."""

from __future__ import annotations

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
    assert table[3] == "| arithmetic | grpo | 0.200 → 0.300 → 0.300 | 0.400 | 0.980 | 0.010 / 0.020 | 30 | 2 |"
    assert table[4] == "| arithmetic | gspo | failed | | | | | |"
    assert best_over_grpo(results[2:], "arithmetic") is None  # no grpo trial
