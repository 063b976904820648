"""Child process for the name_resolve tests. The backend comes from the
REALRL_NAME_RESOLVE_* environment (name_resolve.config_to_env)."""

import os
import sys
import time

from realrl.base import name_resolve


def wait_for_go(go_file: str) -> None:
    while not os.path.exists(go_file):
        time.sleep(0.001)


def main() -> None:
    action, args = sys.argv[1], sys.argv[2:]
    if action == "race_add":
        key, value, go_file = args
        wait_for_go(go_file)
        try:
            name_resolve.add(key, value, replace=False, delete_on_exit=False)
            print("won", flush=True)
        except name_resolve.NameEntryExistsError:
            print("lost", flush=True)
    elif action == "add_subentries":
        root, count, go_file = args
        wait_for_go(go_file)
        for i in range(int(count)):
            print(name_resolve.add_subentry(root, str(i), delete_on_exit=False), flush=True)
    elif action == "hold":
        key, ttl = args
        name_resolve.add(key, str(os.getpid()), keepalive_ttl=float(ttl))
        print("ready", flush=True)
        time.sleep(3600)
    elif action == "add_then_exit":
        (key,) = args
        name_resolve.add(key, "bye")
        name_resolve.add(key + "_kept", "stay", delete_on_exit=False)
        print("ready", flush=True)
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main()
