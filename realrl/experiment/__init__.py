"""From the user's config to a running trial (docs/design.md §10), one concern per module:

- `config`: Hydra composes `realrl/configs/<name>.yaml` (or the user's own
  directory) with `key=value` overrides into an `AsyncPPOConfig`, and the
  values derived from it (trial paths, the environment, agent settings);
- `checks`: what needs the machine (fileroot, plugins, registries, lengths),
  before anything is created;
- `build`: one `WorkerGroup` per worker kind, each worker's config derived;
- `run`: launches the groups (local, Ray, Slurm), restarts with recover=auto.

A script needs two calls, `load_config(overrides)` and `run_experiment(cfg)`;
`realrl train` (realrl/cli/train.py) is those two plus one-line errors.
"""
