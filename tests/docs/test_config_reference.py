"""Config help where users look: every key of the schema has a docstring,
docs/config.md is generated from them (and fails here when it drifts), and
`--help` of the training entry and `realrl config` show them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from realrl.cli.config import REGENERATE, config_sections, field_docs, markdown_reference, text_reference
from realrl.experiment.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_generated_from_the_schema():
    expected = markdown_reference(load_config())
    actual = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert actual == expected, f"docs/config.md is out of date with the schema; regenerate it: {REGENERATE}"


def test_every_key_and_section_has_help():
    sections = config_sections(load_config())
    missing = [key.name for section in sections for key in section.keys if not key.help.strip()]
    missing += [f"section {section.name or 'top level'}" for section in sections if not section.help.strip()]
    assert not missing, f"no docstring under these fields of realrl/api/cli_args.py: {missing}"
    keys = {key.name for section in sections for key in section.keys}
    assert {"ppo.eps_clip", "rollout.gconfig.top_k", "server.sglang.extra_args", "name_resolve.type"} <= keys


def test_field_docs_reads_the_string_under_each_field():
    import dataclasses

    @dataclasses.dataclass
    class Example:
        """The section."""

        a: int = 1
        """What a is,
        over two lines."""
        b: str = ""  # a comment is no help
        c: float = 0.5
        "C's help."

    assert field_docs(Example) == ("The section.", {"a": "What a is,\nover two lines.", "c": "C's help."})


def test_help_of_the_training_entry_and_realrl_config_lists_every_key():
    cfg = load_config()
    proc = subprocess.run(
        [sys.executable, "training/main_async_ppo.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("`python training/main_async_ppo.py [KEY=VALUE ...]"), proc.stdout[:200]
    assert proc.stdout.endswith(text_reference(cfg))
    assert "  ppo.eps_clip: float = 0.2\n      PPO ratio clip ε" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "realrl", "config", "ppo.eps_clip=0.3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text_reference(load_config(["ppo.eps_clip=0.3"]))
    assert "  ppo.eps_clip: float = 0.3 (schema: 0.2)\n" in proc.stdout
