"""A member of a weight broadcast group, in its own process (the tests' stand-in
for a generation server's receiving side): builds the tiny model `kind` from
seed 0 (its version 0), joins the group at `rank`, puts every version it
receives into the model in place (`WeightTargets`, as the torch server does),
and when the sender ends the group writes the model's tensors and the
versions it received to `out`.

    python broadcast_member.py <spec json> <rank> <secret file> <kind> <dtype> <out>
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from realrl.base import trial_secret  # noqa: E402
from realrl.impl.generation.torch_server.weights import WeightTargets  # noqa: E402
from realrl.impl.weights.broadcast import GroupSpec, Receiver  # noqa: E402
from tests.impl.weights.models import tiny_model  # noqa: E402


def main() -> int:
    spec_json, rank, secret_file, kind, dtype, out = sys.argv[1:]
    model = tiny_model(kind, seed=0, dtype=getattr(torch, dtype))
    targets = WeightTargets(model)
    receiver = Receiver(
        GroupSpec.from_json(json.loads(spec_json)),
        int(rank),
        trial_secret.load_keys(secret_file).weights_group_key,
        "127.0.0.1",
        check=lambda manifest: targets.check(manifest.placeholders()),
        on_version=lambda version, tensors: targets.copy_in(tensors),
    )
    receiver.join()
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    save_file(state, out + ".safetensors")
    with open(out + ".json", "w") as f:
        json.dump({"received": receiver.received, "error": receiver.error, "closed": receiver.closed}, f)
    return 0 if receiver.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
