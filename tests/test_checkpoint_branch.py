"""Branch: commit numbering after what the store holds, parents, and moving after a restore."""

from __future__ import annotations

from supervisor.checkpoint.branch import Branch
from supervisor.checkpoint.options import CheckpointInfo

PROVENANCE = ({"torch": "x"}, "abc123", "cfg")


def test_seq_goes_on_after_every_seq_the_store_holds_and_each_save_hangs_off_the_last():
    times = iter([10.0, 20.0])
    branch = Branch(lambda: next(times), PROVENANCE, held_seqs=[3, 7, 5])
    first = branch.next_meta(100, {"loss": 1.5})
    assert (first.id, first.seq, first.step, first.wall_time, first.parent_id) == (
        "0000000100-000008",
        8,
        100,
        10.0,
        None,
    )
    assert (first.versions, first.git_commit, first.config_hash) == PROVENANCE
    branch.moved_to(CheckpointInfo(first.id, 100, first.wall_time, seq=first.seq))
    second = branch.next_meta(100, {})
    assert (second.seq, second.parent_id, second.wall_time) == (9, first.id, 20.0)


def test_already_saved_only_for_the_last_step_and_a_restore_moves_the_branch():
    branch = Branch(lambda: 0.0, PROVENANCE)
    assert branch.already_saved(1) is None
    saved = CheckpointInfo("0000000001-000001", 1, 0.0, seq=1)
    branch.moved_to(saved)
    assert branch.already_saved(1) is saved
    assert branch.already_saved(2) is None
    older = CheckpointInfo("0000000000-000009", 0, 0.0, seq=9)
    branch.moved_to(older)
    assert branch.parent == older.id and branch.already_saved(1) is None
    assert branch.next_meta(5, {}).seq == 1  # an empty store starts at 1
