"""`bench checkpoint --ddp-paths`: one real run at 2 ranks (torchrun, DDP, gloo) measures the rank-0 path and the
sharded path side by side, restores both bit for bit, and gives a verdict per figure; bad options exit 2 before
any process starts. No timing is asserted: this machine is shared."""

from __future__ import annotations

import json

import pytest

from benchmarks.ddp_paths import FIGURES
from supervisor.cli import main

TIMES = {
    "rank0_blocking_save_s",
    "rank0_save_total_s",
    "rank0_restore_s",
    "rank0_restore_own_read_s",
    "sharded_blocking_save_s",
    "sharded_save_total_s",
    "sharded_restore_s",
    "sharded_restore_memory_s",
}


@pytest.mark.e2e
@pytest.mark.slow
def test_ddp_paths_bench_at_two_ranks(tmp_path):
    """About 10-20 s: one torchrun of 2 ranks, 2M parameters, one rep."""
    out = tmp_path / "ddp.json"
    args = ["bench", "checkpoint", "--ddp-paths", "--world-size", "2", "--params", "2M", "--reps", "1"]
    assert main([*args, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["ddp_paths"], r["world_size"], r["reps"], r["device"]) == (True, 2, 1, "cpu")
    assert TIMES == {k for k in r if k.endswith("_s")} - {"reps_s"} and all(r[k] > 0 for k in TIMES)
    assert all(r["reps_s"][k] == [r[k]] for k in TIMES)
    assert r["rank0_save_total_s"] >= r["rank0_blocking_save_s"]
    assert r["sharded_save_total_s"] >= r["sharded_blocking_save_s"]
    assert r["rank0_restore_s"] >= r["rank0_restore_own_read_s"]  # rank 0's read, then the others'
    # About 2M parameters and AdamW's two moments: about 3 x 4 bytes a parameter, on every rank (DDP replicates).
    assert 1.5e6 < r["params"] < 2.5e6 and 11 * r["params"] < r["state_bytes"] < 13 * r["params"]
    # Rank 0 alone writes the full state on the rank-0 path; each rank about half of it on the sharded path.
    ranks = r["per_rank"]
    assert [p["rank"] for p in ranks] == [0, 1]
    assert 1.0 <= ranks[0]["bytes_written"]["rank0_path"] / r["state_bytes"] < 1.01
    assert ranks[1]["bytes_written"]["rank0_path"] == 0
    for p in ranks:
        assert 0.45 < p["bytes_written"]["sharded"] / r["state_bytes"] < 0.55, p
    assert r["bytes_written_total"]["sharded"] == sum(p["bytes_written"]["sharded"] for p in ranks)
    # Every restore gave the saved state back bit for bit, and DDP kept the replicas equal.
    assert r["restored_bit_exact"] == {"rank0_path": True, "sharded": True, "sharded_memory": True}
    assert r["ranks_agree"] is True
    # One verdict per figure, consistent with the medians it names.
    assert set(r["figures"]) == set(FIGURES) == {"save_blocking", "save_total", "restore"}
    for name, (rank0_key, sharded_key) in FIGURES.items():
        v = r["figures"][name]
        assert (v["rank0_path_s"], v["sharded_s"]) == (r[rank0_key], r[sharded_key])
        assert v["faster"] == ("rank0_path" if r[rank0_key] < r[sharded_key] else "sharded")
        assert v["ratio"] == pytest.approx(
            max(r[rank0_key], r[sharded_key]) / min(r[rank0_key], r[sharded_key])
        )
        assert v["clear"] is None  # one rep decides nothing
    assert r["rank0_path_faster_on"] == [n for n, v in r["figures"].items() if v["faster"] == "rank0_path"]
    assert r["first_per_rep"] == ["rank0_path"]
    assert set(r["definitions"]) >= TIMES - {"rank0_restore_own_read_s"} | {"faster", "bytes_written"}
    load = r["load_average"]
    assert len(load["start_1_5_15m"]) == len(load["end_1_5_15m"]) == 3 and len(load["per_rep_1m"]) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ddp.json"]  # the scratch directory is gone


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--ddp-paths", "--world-size", "1"],
            "--world-size: expected at least 2 ranks for a --ddp-paths run",
        ),
        (["--ddp-paths", "--device", "cuda"], "--device: --ddp-paths runs on cpu (gloo DDP), got 'cuda'"),
        (["--ddp-paths", "--sharded"], "--sharded and --ddp-paths: expected one of them, got both"),
        (["--world-size", "2"], "only a --sharded run has ranks; add --sharded (or --ddp-paths)"),
    ],
)
def test_bad_ddp_paths_options_exit_2_with_the_option_named(args, message, capsys, tmp_path):
    assert main(["bench", "checkpoint", *args, "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was made
