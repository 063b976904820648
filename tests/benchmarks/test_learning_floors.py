"""The learning floors' record (benchmarks/learning_floors.json): how a floor is
derived from it, that it covers every run the suite trains as the suite trains
it, and that docs/benchmarks.md shows it as it is. The runs themselves are the
e2e tests that assert the floors (tests/e2e/test_async_ppo.py,
test_algorithms.py, test_lora.py, tests/examples/test_tool_agent.py)."""

from __future__ import annotations

import copy
import os

import pytest

from benchmarks.learning_floors import (
    DOCUMENTED,
    MIN_MARGIN,
    RUNS,
    assert_reaches_floor,
    check_recorded,
    floor,
    load_record,
    readme_range,
    render_docs,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record_of(finals: list[float], initial: float = 0.178) -> dict:
    seeds = {str(k + 1): {"initial": initial, "final": f, "wall_s": 30.0} for k, f in enumerate(finals)}
    return {"runs": {"default": {"what": "w", **RUNS["default"].as_record(), "measured": "today", "seeds": seeds}}}


def test_a_floor_is_the_lowest_seed_minus_the_seeds_range_or_the_minimum_margin():
    assert floor(record_of([0.60, 0.52, 0.70, 0.66, 0.58]), "default") == pytest.approx(0.52 - 0.18)
    # seeds closer together than the evaluation's graininess: the minimum margin
    assert floor(record_of([0.60, 0.61, 0.62, 0.60, 0.61]), "default") == pytest.approx(0.60 - MIN_MARGIN)


def test_a_run_below_its_floor_or_from_another_kit_fails():
    record = record_of([0.60, 0.52, 0.70, 0.66, 0.58])
    summary = {"initial_eval_accuracy": 0.178, "final_eval_accuracy": 0.34, "eval_history": []}
    assert_reaches_floor(summary, "default", record=record)
    with pytest.raises(AssertionError, match="< floor 0.34"):
        assert_reaches_floor({**summary, "final_eval_accuracy": 0.338}, "default", record=record)
    with pytest.raises(AssertionError, match="not the kit the floor was measured on"):
        assert_reaches_floor({**summary, "initial_eval_accuracy": 0.162}, "default", record=record)
    changed = copy.deepcopy(record)
    changed["runs"]["default"]["steps"] = 20
    with pytest.raises(AssertionError, match="re-measure"):
        check_recorded(changed, "default")


def test_every_run_the_suite_trains_is_recorded_as_it_trains_it_well_clear_of_its_start():
    record = load_record()
    assert list(record["runs"]) == list(RUNS)
    for name, run in record["runs"].items():
        check_recorded(record, name)
        assert len(run["seeds"]) >= 5, name
        initial = max(s["initial"] for s in run["seeds"].values())
        # A floor the initial model nearly reaches proves nothing (more steps, then): at least
        # 4 binomial standard errors of a 500-prompt accuracy near 0.2-0.3 (~0.02 each) above it.
        assert floor(record, name) >= initial + 0.075, (name, floor(record, name), initial)


def test_the_readme_figures_were_measured_on_the_readme_command():
    """The documented runs' configuration is the record's: the README's range comes from runs
    of `examples/run_async_ppo.sh` as it is (its recipe line included), not of another recipe."""
    record = load_record()
    assert list(record["documented"]) == list(DOCUMENTED)
    for name, run in DOCUMENTED.items():
        recorded = record["documented"][name]
        assert {k: recorded[k] for k in ("steps", "overrides", "faults")} == run.as_record(), (
            f"re-measure: python benchmarks/learning_floors.py --runs {name} --record"
        )
    assert "optimizer.lr_scheduler=cosine" in DOCUMENTED["readme"].overrides  # read from the script


def test_the_docs_and_the_readme_show_the_record_as_it_is():
    record = load_record()
    with open(os.path.join(REPO, "docs", "benchmarks.md")) as f:
        docs = f.read()
    assert render_docs(docs, record) == docs, "regenerate: python benchmarks/learning_floors.py --docs"
    with open(os.path.join(REPO, "README.md")) as f:
        readme = " ".join(f.read().split())
    # the README's figure for its first command: the range of the recorded runs
    assert f"({readme_range(record)} in the runs recorded" in readme, readme_range(record)
