"""benchmarks/regress.py's comparison: what counts as moved, and what --record writes.
(The benchmarks themselves are not run here: timing on a shared CI machine is noise.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks import regress


def test_a_figure_moves_only_beyond_the_recorded_spread_or_the_floor():
    spread = {"median": 1.50, "runs": [1.40, 1.50, 1.60]}  # tolerance 0.20 (the spread)
    assert regress.verdict(spread, 1.31) == ("held", pytest.approx(0.20))
    assert regress.verdict(spread, 1.29)[0] == "slower"
    assert regress.verdict(spread, 1.71)[0] == "faster"
    tight = {"median": 1.00, "runs": [1.00, 1.00, 1.00]}  # no spread: the floor (3%) decides
    assert regress.verdict(tight, 0.98)[0] == "held"
    assert regress.verdict(tight, 0.96)[0] == "slower"


def test_compare_marks_new_metrics_and_main_exits_1_on_a_slower_one(tmp_path, capsys):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"metrics": {"stream": {"median": 0.9, "runs": [0.88, 0.9, 0.92]}}}))
    results = tmp_path / "results"
    results.mkdir()
    for i, (ratio, acked) in enumerate([(0.80, 0.70), (0.82, 0.71)]):
        (results / f"regress_stream_throughput_{i}.json").write_text(json.dumps({"ratio": ratio, "acked_ratio": acked}))
    rows = regress.compare(
        json.loads(baseline.read_text()), regress.from_json(["stream", "stream_acked"], str(results))
    )
    assert [(r["metric"], r["verdict"]) for r in rows] == [("stream", "slower"), ("stream_acked", "new")]
    args = ["--from-json", str(results), "--baseline", str(baseline), "--only", "stream", "stream_acked"]
    assert regress.main(args) == 1
    assert "slower" in capsys.readouterr().out


def test_a_baseline_from_another_machine_warns_and_does_not_fail(tmp_path, capsys):
    here = regress.this_machine()
    assert here.endswith(f", {os.cpu_count()} cores") and len(here) > len(f", {os.cpu_count()} cores")
    slower = {"median": 0.9, "runs": [0.88, 0.9, 0.92]}
    baseline = tmp_path / "baseline.json"
    results = tmp_path / "results"
    results.mkdir()
    (results / "regress_stream_throughput_0.json").write_text(json.dumps({"ratio": 0.5, "acked_ratio": 0.5}))
    args = ["--from-json", str(results), "--baseline", str(baseline), "--only", "stream"]
    baseline.write_text(json.dumps({"metrics": {"stream": {**slower, "machine": "another CPU, 64 cores"}}}))
    assert regress.main(args) == 0
    out, err = capsys.readouterr()
    assert "slower (recorded on another CPU, 64 cores)" in out and "indicative only" in err
    baseline.write_text(json.dumps({"metrics": {"stream": {**slower, "machine": here}}}))
    assert regress.main(args) == 1  # the same machine: a slower figure fails
    out, err = capsys.readouterr()
    assert "recorded on" not in out and "indicative" not in err


def test_record_keeps_other_metrics_and_says_why(tmp_path):
    baseline = {"metrics": {"generation": {"median": 2.3, "runs": [2.3]}}}
    out = regress.record(baseline, {"stream": [0.9, 0.92, 0.91]}, "AckedPusher: a window of acknowledgements")
    assert out["metrics"]["generation"] == baseline["metrics"]["generation"]
    stream = out["metrics"]["stream"]
    assert stream["median"] == 0.91 and stream["runs"] == [0.9, 0.92, 0.91]
    assert stream["reason"] == "AckedPusher: a window of acknowledgements" and stream["commit"]
    assert stream["machine"] == regress.this_machine()


def test_against_a_commit_the_wider_side_spread_is_the_tolerance():
    measured = {
        "ref": {"vs_inprocess": [1.00, 1.01, 1.02], "stream": [0.80, 0.80, 0.80]},
        "this": {"vs_inprocess": [0.85, 0.95, 1.05], "stream": [0.70, 0.71, 0.72]},
    }
    rows = {r["metric"]: r for r in regress.compare_sides("main", measured)}
    # this side's own spread (0.20) covers 0.95 against 1.01: not a move
    assert rows["vs_inprocess"]["verdict"] == "held" and rows["vs_inprocess"]["tolerance"] == pytest.approx(0.20)
    assert rows["stream"]["verdict"] == "slower" and rows["stream"]["against"] == "main"


def test_against_checks_the_commit_out_apart_and_leaves_no_worktree(tmp_path):
    path = regress.checkout("HEAD", str(tmp_path))
    try:
        assert os.path.isfile(os.path.join(path, "benchmarks", "regress.py"))
        listed = subprocess.run(["git", "worktree", "list"], cwd=regress._REPO, capture_output=True, text=True).stdout
        assert path in listed
    finally:
        regress.remove(path)
    assert not os.path.exists(path)
    assert (
        path
        not in subprocess.run(["git", "worktree", "list"], cwd=regress._REPO, capture_output=True, text=True).stdout
    )
    with pytest.raises(SystemExit, match="not a commit"):
        regress.checkout("no-such-ref-anywhere", str(tmp_path))
