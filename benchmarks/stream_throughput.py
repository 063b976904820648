"""Throughput of the push-pull stream against raw pyzmq.

For trajectories of 256, 2k and 16k tokens (int32 input_ids, float32
logprobs, int32 versions and the usual metadata), a pusher process sends
messages over tcp on 127.0.0.1 to a puller in this process:

- `wire`: ZMQPusher.push(trajectory) -> ZMQPuller.pull() (wire encode + decode), unsealed
  (`security.enabled=false`);
- `sealed`: the same with the trial's seal (HMAC-SHA256 per message and its check,
  docs/design.md §14), as every trial runs it;
- `raw`:  a plain PUSH socket sends one pre-built bytes blob of the same size
  -> a plain PULL socket recv() (no encode, no decode).

The three modes alternate, several rounds each; the table shows the median
msgs/s, wire/raw ("ratio"), sealed/raw and sealed/wire (the seal's own
cost), and the CPU time per message of both processes together (zmq I/O
threads included): on a machine whose cores are busy with other work,
throughput follows the CPU cost, so the CPU ratios are the steadier numbers.
`--json PATH` writes the numbers with top-level "ratio" (wire/raw),
"sealed_ratio" (sealed/raw) and "seal_ratio" (sealed/wire), all at 2k
tokens. `--quick` runs fewer, shorter rounds (< 60 s).

    python benchmarks/stream_throughput.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import zmq

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from realrl.base import wire  # noqa: E402
from realrl.system.push_pull_stream import DEFAULT_HWM, ZMQPuller, ZMQPusher  # noqa: E402

SIZES = [256, 2048, 16384]
MODES = ("raw", "wire", "sealed")
SEAL_KEY = b"benchmark-stream-key-32-bytes..."  # any 32 bytes: the seal's cost does not depend on them


def make_trajectory(n_tokens: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "qid": f"question-{seed:08d}",
        "input_ids": rng.integers(0, 32000, n_tokens, dtype=np.int32),
        "logprobs": rng.standard_normal(n_tokens).astype(np.float32),
        "versions": np.full(n_tokens, 7, dtype=np.int32),
        "reward": 1.0,
        "prompt_len": n_tokens // 4,
        "version_start": 7,
        "version_end": 8,
        "birth_time": time.time(),
    }


def message_bytes(n_tokens: int) -> int:
    return sum(memoryview(f).nbytes for f in wire.encode(make_trajectory(n_tokens)))


# ---- the pusher process -------------------------------------------------------


def run_pusher(mode: str, port: int, n_tokens: int, count: int) -> None:
    """Sends `count` messages, then prints the CPU seconds (all threads) the sending took."""
    if mode != "raw":
        trajectory = make_trajectory(n_tokens)
        pusher = ZMQPusher("127.0.0.1", port, hwm=DEFAULT_HWM, seal_key=SEAL_KEY if mode == "sealed" else None)
        cpu = time.process_time()
        for _ in range(count):
            pusher.push(trajectory)
        pusher.close(linger=60)
    else:
        blob = os.urandom(message_bytes(n_tokens))
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
        sock.connect(f"tcp://127.0.0.1:{port}")
        cpu = time.process_time()
        for _ in range(count):
            sock.send(blob)
        sock.close(linger=60000)
        context.term()
    print(time.process_time() - cpu, flush=True)


# ---- the puller (this process) -------------------------------------------------


def spawn_pusher(mode: str, port: int, n_tokens: int, count: int) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--_pusher", mode, str(port), str(n_tokens), str(count)]
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=REPO_ROOT), stdout=subprocess.PIPE, text=True)


def measure(mode: str, n_tokens: int, count: int) -> tuple[float, float]:
    """(msgs/s from the first message received to the last, CPU microseconds
    per message of both processes together, zmq I/O threads included)."""
    if mode != "raw":
        puller = ZMQPuller("127.0.0.1", None, hwm=DEFAULT_HWM, seal_key=SEAL_KEY if mode == "sealed" else None)
        port = puller.port
    else:
        context = zmq.Context()
        sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, DEFAULT_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = spawn_pusher(mode, port, n_tokens, count)
    cpu = time.process_time()
    try:
        received, start = 0, 0.0
        if mode != "raw":
            while received < count:
                batch = puller.pull(timeout=30.0)
                if not batch:
                    raise RuntimeError("pusher stalled")
                if received == 0:
                    start = time.perf_counter()
                    batch = batch[1:]  # the clock starts at the first message
                    received = 1
                for trajectory in batch:  # touch every message like a consumer would
                    assert trajectory["input_ids"].shape[0] == n_tokens
                received += len(batch)
        else:
            if not sock.poll(30000):
                raise RuntimeError("pusher stalled")
            sock.recv()
            start = time.perf_counter()
            received = 1
            while received < count:
                blob = sock.recv()
                assert len(blob) > 0
                received += 1
        elapsed = time.perf_counter() - start
        puller_cpu = time.process_time() - cpu
        pusher_cpu = float(child.communicate(timeout=120)[0].strip())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if mode != "raw":
            puller.close()
        else:
            sock.close()
            context.term()
    if mode != "raw":
        assert puller.n_rejected == 0 and puller.n_seal_refused == 0
    return (count - 1) / elapsed, (puller_cpu + pusher_cpu) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds (< 60 s)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--_pusher", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._pusher:
        mode, port, n_tokens, count = args._pusher
        run_pusher(mode, int(port), int(n_tokens), int(count))
        return

    rounds = 3 if args.quick else 7
    seconds_per_round = 0.6 if args.quick else 2.0
    rows = []
    for n_tokens in SIZES:
        size = message_bytes(n_tokens)
        # Calibrate the message count so one round takes about seconds_per_round.
        rate_guess, _ = measure("raw", n_tokens, 2000 if n_tokens < 16384 else 500)
        count = max(200, int(rate_guess * seconds_per_round))
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        cpus: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for mode in MODES:
                rate, cpu_us = measure(mode, n_tokens, count)
                rates[mode].append(rate)
                cpus[mode].append(cpu_us)
        rate = {mode: statistics.median(rates[mode]) for mode in MODES}
        cpu = {mode: statistics.median(cpus[mode]) for mode in MODES}
        rows.append(
            {
                "tokens": n_tokens,
                "message_bytes": size,
                "messages_per_round": count,
                **{f"{mode}_msgs_per_s": rate[mode] for mode in MODES},
                **{f"{mode}_MB_per_s": rate[mode] * size / 1e6 for mode in MODES},
                "ratio": rate["wire"] / rate["raw"],
                "sealed_ratio": rate["sealed"] / rate["raw"],
                "seal_ratio": rate["sealed"] / rate["wire"],
                **{f"{mode}_cpu_us_per_msg": cpu[mode] for mode in MODES},
                "cpu_ratio": cpu["raw"] / cpu["wire"],
                "sealed_cpu_ratio": cpu["raw"] / cpu["sealed"],
                "seal_cpu_ratio": cpu["wire"] / cpu["sealed"],
                **{f"{mode}_rounds": rates[mode] for mode in MODES},
            }
        )
        print(f"... {n_tokens} tokens done", file=sys.stderr, flush=True)

    header = (
        f"{'tokens':>7} {'bytes':>8} {'raw msg/s':>10} {'wire msg/s':>11} {'sealed msg/s':>13} {'wire/raw':>9} "
        f"{'sealed/raw':>11} {'sealed/wire':>12} {'raw cpu us':>11} {'wire cpu us':>12} {'sealed cpu us':>14}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['message_bytes']:>8} {r['raw_msgs_per_s']:>10.0f} {r['wire_msgs_per_s']:>11.0f} "
            f"{r['sealed_msgs_per_s']:>13.0f} {r['ratio']:>9.2f} {r['sealed_ratio']:>11.2f} {r['seal_ratio']:>12.2f} "
            f"{r['raw_cpu_us_per_msg']:>11.1f} {r['wire_cpu_us_per_msg']:>12.1f} {r['sealed_cpu_us_per_msg']:>14.1f}"
        )
    at_2k = next(r for r in rows if r["tokens"] == 2048)
    print(
        f"at 2k tokens: wire/raw {at_2k['ratio']:.2f}, sealed/raw {at_2k['sealed_ratio']:.2f}, "
        f"sealed/wire {at_2k['seal_ratio']:.2f} (cpu: {at_2k['seal_cpu_ratio']:.2f})"
    )
    if args.json:
        result = {
            "benchmark": "stream_throughput",
            "quick": args.quick,
            "rounds": rounds,
            "cpu_count": os.cpu_count(),
            "ratio": at_2k["ratio"],
            "sealed_ratio": at_2k["sealed_ratio"],
            "seal_ratio": at_2k["seal_ratio"],
            "sizes": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
