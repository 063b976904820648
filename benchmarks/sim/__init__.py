"""The simulated cluster of `benchmarks/control_plane.py`: stand-ins for the
parts that need a model, around the real control plane.

- `server_host`: a worker hosting many simulated generation servers
  (`realrl.impl.generation.sim_server`), registered under the keys real
  servers use;
- `trainer`: a model worker without a model: it buffers trajectories from its
  puller like the real one, answers the master's requests, takes a configured
  time per trajectory for a train step and publishes a tiny real checkpoint
  per version;
- `agent`: an agent (plugin) that makes several generation calls per episode
  with a tool call's wait between them, and records how long each call took,
  alongside calls made straight to a simulated server.

The master, the manager, the rollout workers, etcd and the launcher are the
real ones.
"""
