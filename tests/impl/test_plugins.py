"""Plugin loading: the example plugin by file and by module path, an entry-point
plugin from a fixture distribution, and the errors a user sees. Registries are
per process, so loading is checked in fresh subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import realrl.impl.agents  # noqa: F401
import realrl.impl.environments  # noqa: F401
from realrl.api.agent_api import AgentSettings, PromptRecord, make_agent
from realrl.api.env_api import make_env
from realrl.base.plugins import PluginError, load_plugin, load_plugins
from realrl.impl.math_data import load_math_jsonl
from realrl.impl.tiny_model import build_char_tokenizer
from tests.impl.test_agents_envs import generation_result, run_episode

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "examples" / "plugins" / "reverse_string"
PLUGIN_FILE = PLUGIN_DIR / "plugin.py"

# Loads the plugins named in argv[1] and reports the registries before/after and
# the error an unknown name gives.
CHILD = """
import json, sys
from realrl.api.agent_api import AGENTS, make_agent
from realrl.api.env_api import ENVIRONMENTS, make_env
from realrl.base.plugins import load_plugins

before = {"agents": AGENTS.names(), "envs": ENVIRONMENTS.names()}
load_plugins(json.loads(sys.argv[1]))
after = {"agents": AGENTS.names(), "envs": ENVIRONMENTS.names()}
try:
    make_env("no-such-env")
except KeyError as e:
    unknown_env = str(e)
print(json.dumps({"before": before, "after": after, "unknown_env": unknown_env}))
"""


def run_child(specs: list[str], cwd: Path, pythonpath: list[str] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(REPO)])
    return subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(specs)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def child_registries(specs: list[str], cwd: Path, pythonpath: list[str] = ()) -> dict:
    proc = run_child(specs, cwd, pythonpath)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "spec, cwd",
    [
        ("examples/plugins/reverse_string/plugin.py", REPO),  # as in the README
        (str(PLUGIN_FILE), None),  # absolute path from elsewhere
        ("examples.plugins.reverse_string.plugin", REPO),  # module path
    ],
    ids=["relative-file", "absolute-file", "module"],
)
def test_example_plugin_registers_its_agent_and_env(spec, cwd, tmp_path):
    out = child_registries([spec], cwd or tmp_path)
    assert "reverse-string-agent" not in out["before"]["agents"]
    assert "reverse-string" not in out["before"]["envs"]
    assert "reverse-string-agent" in out["after"]["agents"]
    assert "reverse-string" in out["after"]["envs"]
    assert "'no-such-env'" in out["unknown_env"] and "reverse-string" in out["unknown_env"]


def write_distribution(site: Path, dist: str, entry_name: str, module: str, source: str) -> None:
    """A minimal installed distribution: a module plus a .dist-info with an
    entry point in realrl's group (what `pip install` of a plugin package leaves)."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[realrl.plugins]\n{entry_name} = {module}\n")


def test_entry_point_plugin_is_loaded_without_configuration(tmp_path):
    write_distribution(
        tmp_path,
        "realrl_fixture_plugin",
        "fixture",
        "realrl_fixture_plugin_mod",
        """
        from realrl.api.agent_api import Agent, register_agent
        from realrl.api.env_api import EnvironmentService, register_environment

        class FixtureEnv(EnvironmentService):
            async def step(self, action):
                return None, 0.0, True, False, {}

        class FixtureAgent(Agent):
            async def collect_trajectory(self, prompt, env):
                return []

        register_environment("fixture-env", FixtureEnv)
        register_agent("fixture-agent", FixtureAgent)
    """,
    )
    out = child_registries([], REPO, pythonpath=[tmp_path])
    assert "fixture-agent" not in out["before"]["agents"]
    assert "fixture-agent" in out["after"]["agents"] and "fixture-env" in out["after"]["envs"]
    # Without the distribution on the path nothing is added.
    out = child_registries([], REPO)
    assert "fixture-agent" not in out["after"]["agents"]


def test_broken_entry_point_plugin_names_itself(tmp_path):
    write_distribution(
        tmp_path,
        "realrl_broken_plugin",
        "broken",
        "realrl_broken_plugin_mod",
        "raise RuntimeError('broken at import')\n",
    )
    proc = run_child([], REPO, pythonpath=[tmp_path])
    assert proc.returncode != 0
    assert "PluginError" in proc.stderr and "'broken'" in proc.stderr and "broken at import" in proc.stderr


def test_unknown_names_list_what_is_registered():
    with pytest.raises(KeyError) as agent_error:
        make_agent("math-single-stpe")
    assert "math-single-stpe" in str(agent_error.value)
    assert "math-single-step" in str(agent_error.value) and "math-multi-turn" in str(agent_error.value)
    with pytest.raises(KeyError) as env_error:
        make_env("maths")
    assert "'maths'" in str(env_error.value) and "'math'" in str(env_error.value)


def test_plugin_that_raises_on_import_gives_a_plugin_error(tmp_path):
    bad = tmp_path / "bad_plugin_for_test.py"
    bad.write_text("raise ValueError('plugin exploded')\n")
    with pytest.raises(PluginError) as err:
        load_plugins([str(bad)])
    assert str(bad) in str(err.value) and "plugin exploded" in str(err.value)
    with pytest.raises(PluginError, match="does not exist"):
        load_plugin(str(tmp_path / "missing_plugin.py"))
    with pytest.raises(PluginError, match="no_such_module_for_realrl"):
        load_plugin("no_such_module_for_realrl.plugin")


# ---------------------------------------------------------------- the example itself


def test_make_data_writes_the_prompt_format(tmp_path):
    def make(out: Path) -> None:
        subprocess.run(
            [
                sys.executable,
                str(PLUGIN_DIR / "make_data.py"),
                "--out-dir",
                str(out),
                "--n-train",
                "60",
                "--n-test",
                "15",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

    make(tmp_path / "a")
    make(tmp_path / "b")
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()  # deterministic

    train = load_math_jsonl(str(tmp_path / "a" / "train.jsonl"))
    test = load_math_jsonl(str(tmp_path / "a" / "test.jsonl"))
    assert len(train) == 60 and len(test) == 15
    tokenizer = build_char_tokenizer()
    for rec in train + test:
        raw = {k: rec[k] for k in ("query_id", "prompt", "answer", "task")}
        assert raw["task"] == "reverse_string"
        assert raw["prompt"].startswith("Reverse: ") and raw["prompt"].endswith("\nA:")
        word = raw["prompt"][len("Reverse: ") : -len("\nA:")]
        assert 3 <= len(word) <= 5 and raw["answer"] == word[::-1]
        assert tokenizer.unk_token_id not in tokenizer.encode(raw["prompt"] + raw["answer"], add_special_tokens=False)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_example_agent_and_env_collect_a_trajectory(tmp_path):
    load_plugin(str(PLUGIN_FILE))  # registers in this process (idempotent per spec)
    tokenizer = build_char_tokenizer()
    prompt_text = "Reverse: abc\nA:"
    prompt = PromptRecord(
        qid="r-1",
        prompt=prompt_text,
        task="reverse_string",
        solutions=["cba"],
        prompt_ids=tokenizer.encode(prompt_text, add_special_tokens=False),
    )
    settings = AgentSettings(tokenizer=tokenizer, group_size=4, gconfig={"max_new_tokens": 8})
    agent = make_agent("reverse-string-agent", settings)
    first = ["cba", "cbx", "xyz", "cba\nReverse: q"]

    def answer(req):  # first attempts, then every retry gets it right
        return generation_result(tokenizer, req, first if req.group_size == 4 else ["cba"])

    trajs, requests = run_episode(agent, make_env("reverse-string"), prompt, answer)
    assert [r.group_size for r in requests] == [4, 1, 1] and requests[0].gconfig.max_new_tokens == 8
    # The two inexact answers were told how much they got right and retried.
    assert [tokenizer.decode(r.prompt_ids) for r in requests[1:]] == [
        prompt_text + "cbx\n2 right. Again:",
        prompt_text + "xyz\n0 right. Again:",
    ]
    (traj,) = trajs
    assert traj.task == "reverse_string" and traj.group_size == 6
    # scores: exact 1, prefix 2/3 of the target -> 0.5 * 2/3, nothing 0, exact after cutting at newline 1; retries exact
    assert traj.scores == pytest.approx([1.0, 1 / 3, 0.0, 1.0, 1.0, 1.0])
    assert traj.reward == pytest.approx([1.0, -1 / 3, -1.0, 1.0, 1.0, 1.0])
    assert traj.metadata["max_generate_in_flight"] == 2  # the retries ran together

    uniform, _ = run_episode(
        agent,
        make_env("reverse-string"),
        prompt,
        lambda req: generation_result(tokenizer, req, ["zzz"] * req.group_size),
    )
    assert uniform == []  # all first answers scored the same: no GRPO signal, dropped
