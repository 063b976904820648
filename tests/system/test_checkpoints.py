"""Recovery checkpoints on disk: atomic commit, manifest checks, fallback, pruning."""

from __future__ import annotations

import os

from realrl.system import checkpoints


def write(root: str, step: int, payload: bytes = b"weights") -> str:
    temp = checkpoints.new_temp_dir(root, step)
    with open(os.path.join(temp, "model_worker.pt"), "wb") as f:
        f.write(payload)
    with open(os.path.join(temp, "master_state.json"), "w") as f:
        f.write(f'{{"step": {step}}}')
    return checkpoints.commit(temp, root, step)


def test_commit_verify_fall_back_and_prune(tmp_path):
    root = str(tmp_path)
    assert checkpoints.newest_valid(root) is None
    for step in (3, 6, 9):
        write(root, step, payload=bytes([step]) * 1000)
    # Only the newest KEEP are kept, and no temporary directory is left.
    assert sorted(os.listdir(root)) == ["step6", "step9"]
    assert checkpoints.problem(os.path.join(root, "step9")) is None
    assert checkpoints.newest_valid(root) == os.path.join(root, "step9")

    with open(os.path.join(root, "step9", "model_worker.pt"), "r+b") as f:  # one byte changed
        f.seek(10)
        f.write(b"\x00")
    assert (
        checkpoints.problem(os.path.join(root, "step9")) == "model_worker.pt does not match its sha256 in the manifest"
    )
    assert checkpoints.newest_valid(root) == os.path.join(root, "step6")

    os.truncate(os.path.join(root, "step6", "master_state.json"), 3)
    assert "has 3 bytes" in checkpoints.problem(os.path.join(root, "step6"))
    os.remove(os.path.join(root, "step6", "MANIFEST.json"))
    assert "no readable MANIFEST.json" in checkpoints.problem(os.path.join(root, "step6"))
    assert checkpoints.newest_valid(root) is None


def test_a_half_written_checkpoint_is_never_used(tmp_path):
    root = str(tmp_path)
    write(root, 2)
    temp = checkpoints.new_temp_dir(root, 4)  # a crash while step 4 was being written
    open(os.path.join(temp, "model_worker.pt"), "wb").close()
    assert checkpoints.newest_valid(root) == os.path.join(root, "step2")
    write(root, 4)  # the next checkpoint clears the leftover
    assert sorted(os.listdir(root)) == ["step2", "step4"]
