"""The checkpoint layout (``slipstream/utils/checkpoints.py``) and the run checkpoint's rollouter state,
on files only."""

from __future__ import annotations

import json

from slipstream.pipeline import checkpoint as ckpt
from slipstream.rollouter.state import GateCount, PendingPrompt, PromptPosition, RolloutState
from slipstream.utils import checkpoints


def test_only_renamed_complete_checkpoints_count_and_pruning_keeps_the_newest(tmp_path):
    root = checkpoints.checkpoint_root(tmp_path)
    for version in (2, 4, 6):
        staging = checkpoints.staging_dir(root, version)
        checkpoints.mark_complete(staging, version)
        checkpoints.commit(staging)
    checkpoints.staging_dir(root, 8)  # a save that crashed
    (root / "step_00000007").mkdir()  # no COMPLETE marker
    assert checkpoints.latest(root) == root / "step_00000006"
    assert checkpoints.read_version(root / "step_00000004") == 4
    checkpoints.prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006", "step_00000007"]


def test_the_rollouter_state_round_trips_through_a_checkpoint(tmp_path):
    state = RolloutState(
        prompts=PromptPosition(epoch=1, offset=3, seed=7, shuffle=True, size=12),
        gate=GateCount(admitted=5, refunded=1),
        pending=[PendingPrompt(1, 2), PendingPrompt(0, 9, attempt=1, resamples=2)],
    )
    ckpt.write_rollouter_state(tmp_path, state)
    assert ckpt.read_rollouter_state(tmp_path) == state
    written = json.loads((tmp_path / ckpt.ROLLOUTER_STATE).read_text())
    assert written["pending"] == [[1, 2, 0, 0], [0, 9, 1, 2]]  # the compact form of earlier checkpoints


def test_a_rollouter_state_written_as_lists_before_it_was_typed_still_resumes(tmp_path):
    old = {
        "prompts": {"epoch": 0, "offset": 6, "seed": 0, "shuffle": False, "size": 8},
        "gate": {"admitted": 4},
        "pending": [[0, 4, 0, 1], [0, 5, 2]],  # the oldest form has no `resamples`
    }
    (tmp_path / ckpt.ROLLOUTER_STATE).write_text(json.dumps(old))
    state = ckpt.read_rollouter_state(tmp_path)
    assert state.gate == GateCount(admitted=4, refunded=0)
    assert state.pending == [PendingPrompt(0, 4, 0, 1), PendingPrompt(0, 5, 2, 0)]
    assert state.prompts.as_dict() == old["prompts"]


def test_no_rollouter_state_in_a_trainer_only_checkpoint(tmp_path):
    assert ckpt.read_rollouter_state(tmp_path) is None
