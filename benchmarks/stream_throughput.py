"""Throughput of the push-pull stream against raw pyzmq.

For trajectories of 256, 2k and 16k tokens (int32 input_ids, float32
logprobs, int32 versions and the usual metadata), a pusher process sends
messages over tcp on 127.0.0.1 to a puller in this process:

- `wire`: ZMQPusher.push(trajectory) -> ZMQPuller.pull() (wire encode + decode);
- `acked`: acknowledged delivery with a window in flight: an AckedPusher
  gets the trajectories 64 to a `submit` (one future per call, as a producer
  with many at hand would; the rollout worker submits an episode's in one),
  each under its own key, and waits for every verdict (what is queued
  together goes as one frame, up to 64 trajectories, as the rollout worker's
  delivery sends a burst); the puller decodes, and acknowledges each pull
  with one message per sender listing its verdicts;
- `acked1` (with `--serial-acks`): one round trip per message (push, wait for
  its acknowledgement, push the next), as the rollout worker delivers today
  (docs/design.md §12);
- `sealed`: `wire` with the trial's seal on every message (docs/design.md §4, §14),
  as every trial with security on sends; "seal ratio" is sealed/wire, the seal's own cost;
- `raw`:  a plain PUSH socket sends one pre-built bytes blob of the same size
  -> a plain PULL socket recv() (no encode, no decode).

The modes alternate, several rounds each; the table shows the median msgs/s
and MB/s, each mode's ratio to raw (wire/raw is "ratio", acked/raw
"acked ratio"), and the CPU time per message of both processes together (zmq
I/O threads included) with raw/mode ("cpu ratio"): on a machine whose cores
are busy with other work, throughput follows the CPU cost, so the CPU ratio
is the steadier number. `--json PATH` writes the numbers with a top-level
"ratio" (wire/raw at 2k tokens) and "acked_ratio" (acked/raw at 2k tokens).
`--quick` runs fewer, shorter rounds (< 90 s).

    python benchmarks/stream_throughput.py [--quick] [--serial-acks] [--json PATH]
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
from realrl.system.acked_delivery import AckedPusher  # noqa: E402
from realrl.system.push_pull_stream import DEFAULT_HWM, ZMQPuller, ZMQPusher  # noqa: E402

SIZES = [256, 2048, 16384]
SUBMIT_BATCH = 64  # acked: trajectories per AckedPusher.submit (one future each), as many as one frame holds
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
        "rollout_id": "0:0:1",
        "index": 0,
    }


def message_bytes(n_tokens: int) -> int:
    return sum(memoryview(f).nbytes for f in wire.encode(make_trajectory(n_tokens)))


# ---- the pusher process -------------------------------------------------------


def run_pusher(mode: str, port: int, n_tokens: int, count: int) -> None:
    """Sends `count` messages, then prints the CPU seconds (all threads) the sending took."""
    if mode in ("wire", "sealed", "acked", "acked1"):
        trajectory = make_trajectory(n_tokens)
        pusher = ZMQPusher("127.0.0.1", port, hwm=DEFAULT_HWM, seal_key=SEAL_KEY if mode == "sealed" else None)
        cpu = time.process_time()
        if mode in ("wire", "sealed"):
            for _ in range(count):
                pusher.push(trajectory)
        elif mode == "acked":
            delivery = AckedPusher(pusher)
            futures = []
            for first in range(0, count, SUBMIT_BATCH):
                indices = range(first, min(count, first + SUBMIT_BATCH))
                messages = [dict(trajectory, index=i) for i in indices]
                futures.append(delivery.submit(messages, [("0:0:1", i) for i in indices]))
            for future in futures:
                assert all(ack["verdict"] == "taken" for ack in future.result(timeout=120))
            delivery.close()
        else:
            for i in range(count):
                pusher.push(dict(trajectory, index=i))
                assert pusher.wait_ack(120)[0]["index"] == i
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
            acked = mode not in ("wire", "sealed")
            while received < count:
                batch = puller.pull_with_senders(timeout=30.0)
                if not batch:
                    raise RuntimeError("pusher stalled")
                if received == 0:
                    start = time.perf_counter()
                acks: dict[bytes, list] = {}
                for sender, trajectory in batch:  # touch every message like a consumer would
                    assert trajectory["input_ids"].shape[0] == n_tokens
                    if acked:  # one acknowledgement per sender per pull, as PullerStreamDataset sends
                        key = {"rollout_id": trajectory["rollout_id"], "index": trajectory["index"]}
                        acks.setdefault(sender, []).append(dict(key, verdict="taken"))
                for sender, verdicts in acks.items():
                    puller.acknowledge(sender, verdicts)
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
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds (< 90 s)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument(
        "--serial-acks", action="store_true", help="add acked1: one round trip per message (the delivery before)"
    )
    parser.add_argument("--_pusher", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._pusher:
        mode, port, n_tokens, count = args._pusher
        run_pusher(mode, int(port), int(n_tokens), int(count))
        return

    rounds = 3 if args.quick else 7
    seconds_per_round = 0.6 if args.quick else 2.0
    modes = ["raw", "wire", "sealed", "acked"] + (["acked1"] if args.serial_acks else [])
    rows = []
    for n_tokens in SIZES:
        size = message_bytes(n_tokens)
        # Calibrate the message count so one round takes about seconds_per_round.
        rate_guess, _ = measure("raw", n_tokens, 2000 if n_tokens < 16384 else 500)
        count = max(200, int(rate_guess * seconds_per_round))
        rates: dict[str, list[float]] = {m: [] for m in modes}
        cpus: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(rounds):
            for mode in modes:
                # one round trip per message is slow: fewer messages keep its round short
                rate, cpu_us = measure(mode, n_tokens, count if mode != "acked1" else max(200, count // 8))
                rates[mode].append(rate)
                cpus[mode].append(cpu_us)
        rate = {m: statistics.median(rates[m]) for m in modes}
        cpu = {m: statistics.median(cpus[m]) for m in modes}
        row = {"tokens": n_tokens, "message_bytes": size, "messages_per_round": count}
        for m in modes:
            row[f"{m}_msgs_per_s"] = rate[m]
            row[f"{m}_MB_per_s"] = rate[m] * size / 1e6
            row[f"{m}_cpu_us_per_msg"] = cpu[m]
            row[f"{m}_rounds"] = rates[m]
            if m != "raw":
                prefix = "" if m == "wire" else f"{m}_"
                row[f"{prefix}ratio"] = rate[m] / rate["raw"]
                row[f"{prefix}cpu_ratio"] = cpu["raw"] / cpu[m]
        row["seal_ratio"] = rate["sealed"] / rate["wire"]  # the seal's own cost
        row["seal_cpu_ratio"] = cpu["wire"] / cpu["sealed"]
        rows.append(row)
        print(f"... {n_tokens} tokens done", file=sys.stderr, flush=True)

    header = f"{'tokens':>7} {'bytes':>8} " + " ".join(f"{m + ' msg/s':>12}" for m in modes)
    header += " " + " ".join(f"{m + ' ratio':>13} {'cpu':>5}" for m in modes if m != "raw")
    print(header)
    for r in rows:
        line = f"{r['tokens']:>7} {r['message_bytes']:>8} " + " ".join(f"{r[m + '_msgs_per_s']:>12.0f}" for m in modes)
        for m in modes[1:]:
            prefix = "" if m == "wire" else f"{m}_"
            line += f" {r[prefix + 'ratio']:>13.2f} {r[prefix + 'cpu_ratio']:>5.2f}"
        print(line)
    row_2k = next(r for r in rows if r["tokens"] == 2048)
    print(
        f"ratio at 2k tokens: wire/raw {row_2k['ratio']:.2f}, acked/raw {row_2k['acked_ratio']:.2f}, "
        f"sealed/wire {row_2k['seal_ratio']:.2f} (cpu {row_2k['seal_cpu_ratio']:.2f})"
    )
    if args.json:
        result = {
            "benchmark": "stream_throughput",
            "quick": args.quick,
            "rounds": rounds,
            "cpu_count": os.cpu_count(),
            "ratio": row_2k["ratio"],
            "acked_ratio": row_2k["acked_ratio"],
            "seal_ratio": row_2k["seal_ratio"],
            "sizes": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
