"""Config loading (realrl/experiment/config.py): the package's defaults, another
defaults file by name, and a user's own config directory that builds on the
package's files (and the package's defaults on the user's groups)."""

from __future__ import annotations

import pytest

from realrl.api.cli_args import ConfigError
from realrl.experiment.config import CONFIG_DIR, load_config


def test_the_defaults_come_from_the_package():
    assert CONFIG_DIR.endswith("realrl/configs")
    cfg = load_config(["ppo.eps_clip=0.3"])
    assert (cfg.experiment_name, cfg.total_train_steps, cfg.ppo.eps_clip) == ("async-ppo-tiny", 200, 0.3)


def test_a_user_config_dir_builds_on_the_package_files(tmp_path):
    config_dir = tmp_path / "my configs, 'quoted'"  # a path Hydra's override grammar must quote
    (config_dir / "algo").mkdir(parents=True)
    (config_dir / "mine.yaml").write_text("defaults:\n  - async-ppo\n  - _self_\ntotal_train_steps: 7\n")
    (config_dir / "algo" / "clipped.yaml").write_text("# @package _global_\nppo:\n  eps_clip: 0.1\n")
    cfg = load_config(["rollout.n_workers=2"], "mine", str(config_dir))
    assert (cfg.experiment_name, cfg.total_train_steps, cfg.rollout.n_workers) == ("async-ppo-tiny", 7, 2)
    # The package's defaults, with a group from the user's directory.
    cfg = load_config(["+algo=clipped"], config_dir=str(config_dir))
    assert (cfg.total_train_steps, cfg.ppo.eps_clip) == (200, 0.1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"config_name": "nosuch"}, "Cannot find primary config 'nosuch'"),
        ({"config_dir": "/nonexistent/configs"}, "--config-dir: no such directory /nonexistent/configs"),
        ({"overrides": ["ppo.nosuch=1"]}, "ppo.nosuch: "),
    ],
)
def test_a_bad_name_or_directory_is_one_line(kwargs, message):
    with pytest.raises(ConfigError) as e:
        load_config(**kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
