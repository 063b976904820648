"""Runs a LocalLauncher in its own process (so a test can SIGKILL it).
Prints one line of JSON with the worker PIDs once they are started."""

import json
import sys
import threading
import time

from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher, WorkerGroup

fileroot, ttl = sys.argv[1], float(sys.argv[2])
launcher = LocalLauncher("launchtest", "sigkill", fileroot, NameResolveConfig(type="etcd3"), heartbeat_ttl=ttl)
groups = [
    WorkerGroup("tests.launcher.workers_for_tests:CountingWorker", 2, {}),
    WorkerGroup("tests.launcher.workers_for_tests:AsyncCountingWorker", 1),
    WorkerGroup("tests.launcher.workers_for_tests:SpawningWorker", 1),
]


def report():
    while len(launcher.worker_pids) < 4:
        time.sleep(0.05)
    print(json.dumps({"workers": launcher.worker_pids, "etcd": launcher._etcd_supervisor.pid}), flush=True)


threading.Thread(target=report, daemon=True).start()
sys.exit(launcher.run(groups))
