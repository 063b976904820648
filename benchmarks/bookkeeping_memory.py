"""Memory of the delivery bookkeeping over a long run: a trainer's puller and the manager.

    python benchmarks/bookkeeping_memory.py [--quick] [--rows 100000] [--epochs 10]
        [--code DIR] [--json PATH]

`--rows` prompts per epoch, `--epochs` epochs: rows x epochs rollouts of one
trajectory each (1M by default), as a long trial would produce them, through
the real bookkeeping of the two processes that keep a record per rollout,
without sockets or a model:

- the manager's `StalenessController`: `allocate` and `finish` per rollout
  (5 % rejected by the agent), as `/allocate_rollout` and `/finish_rollout`;
- a `PullerStreamDataset`'s `_add` per trajectory (what its thread does with
  each message it pulls: validation, the key check, the buffer), and every
  512 trajectories `inventory` + `take` (a train step; 10 % of them are a
  version behind and dropped as stale), as the master asks.

Rollout ids are `<worker>:<epoch>:<row>` over 4 rollout workers. Every
`--every` rollouts the process's resident memory (RSS, psutil) is recorded,
relative to the start; a bookkeeping that keeps a record per trajectory
grows linearly, one that keeps bits per dataset row and epoch stays flat
(one bit per row for each epoch begun). `--code DIR` imports realrl from
another checkout (e.g. `git archive <commit> realrl | tar -x -C DIR`), to
measure a version before a change with the same script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--every", type=int, default=100_000, help="rollouts between memory samples")
    parser.add_argument("--quick", action="store_true", help="20k rows x 5 epochs")
    parser.add_argument("--code", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.epochs, args.every = 20_000, 5, 20_000
    sys.path.insert(0, os.path.abspath(args.code))

    import numpy as np
    import psutil

    from realrl.api.trajectory import Trajectory
    from realrl.system.staleness import StalenessController
    from realrl.system.stream_dataset import PullerStreamDataset

    process = psutil.Process()

    def trajectory(version: int) -> dict:
        return Trajectory(
            qid="q",
            task="math",
            birth_time=0.0,
            input_ids=[np.arange(12, dtype=np.int32) % 7],
            prompt_len=[4],
            logprobs=[np.full(8, -1.0, np.float32)],
            versions=[np.full(8, version, np.int32)],
            version_start=[version],
            version_end=[version],
            reward=[1.0],
            no_eos=[False],
        ).to_wire()

    template, stale = trajectory(1), trajectory(0)

    manager = StalenessController(train_batch_size=512, max_head_offpolicyness=1 << 30, max_concurrent_rollouts=1 << 20)
    manager.start()
    puller = PullerStreamDataset("bookkeeping", f"bench{os.getpid()}", 0, vocab_size=10)
    gc.collect()
    start_rss = process.memory_info().rss
    samples = []
    n = dropped = rejected = 0
    t0 = time.monotonic()
    for epoch in range(args.epochs):
        for row in range(args.rows):
            rid = f"{row % 4}:{epoch}:{row}"
            manager.allocate(rid, f"q{row}@{epoch}")
            if row % 20 == 19:  # the agent rejected it: nothing pushed
                manager.finish(rid, 0)
                rejected += 1
            else:
                msg = dict(stale if row % 10 == 3 else template, rollout_id=rid, index=0, qid=f"q{row}@{epoch}")
                puller._add(msg)
                manager.finish(rid, 1)
            n += 1
            if n % 512 == 0:  # a train step: stale ones dropped, the rest taken
                items, k = puller.inventory(1, 1 << 20)
                dropped += k
                puller.take([key for key, *_ in items])
            if n % args.every == 0:
                gc.collect()
                samples.append({"rollouts": n, "rss_mb": (process.memory_info().rss - start_rss) / 2**20})
                print(f"{n:>9} rollouts  rss +{samples[-1]['rss_mb']:8.1f} MB  ({time.monotonic() - t0:.0f} s)")
    puller.close()
    stats = puller.stats()
    per_million = (samples[-1]["rss_mb"] - samples[0]["rss_mb"]) / max(1, n - samples[0]["rollouts"]) * 1e6
    result = {
        "code": os.path.abspath(args.code),
        "rows": args.rows,
        "epochs": args.epochs,
        "rollouts": n,
        "rejected": rejected,
        "dropped_stale": dropped,
        "taken": stats["taken"],
        "samples": samples,
        "rss_growth_mb_per_million_after_first_sample": per_million,
    }
    print(f"\n{'rollouts':>10} | {'rss growth (MB)':>15}")
    for s in samples:
        print(f"{s['rollouts']:>10} | {s['rss_mb']:>15.1f}")
    print(f"growth after the first sample: {per_million:.1f} MB per million rollouts")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
