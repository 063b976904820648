"""The data ledger (docs/design.md §12): per-epoch bitmaps on disk, a pointer
in the name service, and the redo list a resumed trial or a restarted rollout
worker computes from it."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

from realrl.base import name_resolve, names
from realrl.base.name_resolve import NameResolveConfig
from realrl.system.ledger import LEDGER_FILE, KeyLedger, Ledger, parse_rollout_id, resume_info, rollout_id, undone
from tests.conftest import make_nr_config


def test_checkpoint_ledger_round_trip(tmp_path):
    ledger = Ledger()
    foreign = ledger.mark_ids(["0:0:3", "1:0:4", "0:2:1000", "junk", "0:0:3:x", "", "-1:0:2"])
    assert foreign == 4  # only `<worker>:<epoch>:<row>` ids are rollouts of ours
    assert ledger.count() == 3 and ledger.epochs == [0, 2]
    path = str(tmp_path / LEDGER_FILE)
    ledger.save(path)
    back = Ledger.load(path)
    assert back.count() == 3 and back.epochs == [0, 2]
    assert back.done(0, [3, 4, 5, 10**9]).tolist() == [True, True, False, False]
    assert back.is_done("0:2:1000") and not back.is_done("0:2:999") and not back.is_done("0:1:3")
    assert parse_rollout_id(rollout_id(3, 1, 7)) == (3, 1, 7) and parse_rollout_id("a:1:2") is None
    merged = Ledger().update(back)
    merged.mark(5, 0)
    assert merged.count() == 4 and back.count() == 3


def test_undone_positions_scan_every_epoch_up_to_the_cursor():
    """Every epoch up to the cursor's is scanned, in issue order; rows done
    in the ledger are left out, whichever epoch they are in."""
    rows = np.array([10, 20, 30, 40])  # prompt i's dataset row

    def order_of(epoch):
        return np.roll(np.arange(4), epoch)  # epoch 0: 0 1 2 3, epoch 1: 3 0 1 2, epoch 2: 2 3 0 1

    ledger = Ledger()
    ledger.mark_ids(["0:0:10", "0:0:20", "0:0:40", "0:1:40", "0:1:10", "0:1:20", "0:1:30", "0:2:30"])
    # epoch 0: row 30 (prompt 2) left; epoch 1: none; epoch 2, 3 issued (prompts 2, 3, 0): 2 is done
    assert undone(ledger, order_of, rows, 2, 3) == [(0, 2), (2, 3), (2, 0)]
    assert undone(Ledger(), order_of, rows, 0, 2) == [(0, 0), (0, 1)]
    assert undone(ledger, order_of, rows, 0, 0) == []


def test_a_resume_of_a_200k_prompt_ledger_keeps_every_name_service_value_small(tmp_path, etcd_server):
    """200k prompts, four rollout workers, two epochs trained and a third
    under way: the checkpoint's ledger stays on disk, training_start (real
    etcd) carries a pointer, every value under the trial root is small, and
    each worker's redo list from the pointer is exactly what is not done."""
    n_prompts, n_workers, epoch = 200_000, 4, 2
    rng = np.random.default_rng(0)
    checkpoint = tmp_path / "checkpoints" / "step40"
    checkpoint.mkdir(parents=True)
    ledger = Ledger()
    not_done = {}  # worker -> set of (epoch, row) left undone
    cursors = {}
    for w in range(n_workers):
        rows = np.arange(w, n_prompts, n_workers)
        position = len(rows) // 2
        missing = set()
        for e in range(epoch + 1):
            issued = rows[: len(rows) if e < epoch else position]  # the worker's order: the shard's
            holes = set(rng.choice(issued, 7, replace=False).tolist())  # in flight at the checkpoint
            for row in issued:
                if row not in holes:
                    ledger.mark(e, int(row))
            missing |= {(e, r) for r in holes}
        not_done[w] = missing
        cursors[str(w)] = {"epoch": epoch, "position": position, "regenerated": 0}
    ledger.save(str(checkpoint / LEDGER_FILE))
    state = {"ledger": LEDGER_FILE, "rollout_cursors": cursors}
    assert os.path.getsize(checkpoint / LEDGER_FILE) < 100_000  # 3 epochs of 200k bits, compressed

    name_resolve.reconfigure(make_nr_config("etcd3", tmp_path, etcd_server))
    exp, trial = "ledger", uuid.uuid4().hex[:8]
    try:
        _, resume = resume_info(str(checkpoint), state, 16, str(tmp_path / "checkpoints"))
        start = {"step": 40, "version": 40, "consumed": 640, "dropped": 0, "filtered": 0, **resume}
        name_resolve.add(names.training_start(exp, trial), json.dumps(start), replace=True)
        for w, c in cursors.items():
            name_resolve.add(names.rollout_cursor(exp, trial, int(w)), json.dumps(c), replace=True)
        root = names.trial_root(exp, trial)
        values = name_resolve.get_subtree(root)
        assert len(values) == 1 + n_workers
        assert max(len(v.encode()) for v in values) < 1024, sorted(len(v) for v in values)

        # A rollout worker's side: the pointer, the ledger, the redo list.
        got = json.loads(name_resolve.get(names.training_start(exp, trial)))
        loaded = Ledger.load(got["ledger"])
        for w in range(n_workers):
            rows = np.arange(w, n_prompts, n_workers)
            redo = undone(loaded, lambda e, n=len(rows): np.arange(n), rows, epoch, cursors[str(w)]["position"])
            assert {(e, int(rows[i])) for e, i in redo} == not_done[w] and len(redo) == 7 * (epoch + 1)
    finally:
        name_resolve.reconfigure(NameResolveConfig())


def test_the_wire_form_and_the_key_ledger_hold_bits_not_ids():
    """What the manager answers (`Ledger.to_wire`) and what a puller keeps of
    the keys it took (`KeyLedger`) round-trip exactly, refuse what they do
    not write, and take one bit per row and epoch however many ids pass."""
    ledger = Ledger()
    ledger.mark_ids(["0:0:3", "2:0:9", "1:4:100000"])
    back = Ledger.from_wire(ledger.to_wire())
    assert [back.is_done(r) for r in ("5:0:3", "0:0:9", "0:4:100000", "0:4:99999", "0:1:3")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    for bad in ([1], {"x": {"rows": 1, "bits": "AA=="}}, {"0": {"rows": 9, "bits": "AA=="}}, {"0": {"rows": 1}}):
        with pytest.raises(ValueError):
            Ledger.from_wire(bad)

    keys = KeyLedger()
    for epoch in range(20):
        for row in range(1000):
            keys.add((f"{row % 4}:{epoch}:{row}", row % 2))
    assert ("1:3:5", 1) in keys and ("1:3:5", 0) not in keys and ("0:20:0", 0) not in keys
    assert keys.nbytes() <= 20 * 2 * 2048  # 40k keys: a byte per row (grown by doubling), epoch, index; a set: ~6 MB
    assert ("2:7:6", 0) in KeyLedger.from_wire(keys.to_wire())
    with pytest.raises(ValueError):
        keys.add(("foreign", 0))
