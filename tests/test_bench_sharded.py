"""`bench checkpoint --sharded`: one real run at 2 ranks (torchrun, FSDP2, gloo) writes every key of issue 17's
table with sane values; bad options exit 2 with a message that names the option, before any process starts.
No timing is asserted: this machine is shared."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.sharded_checkpoint import TARGETS
from supervisor.cli import main

TIMES = {
    "blocking_save_s",
    "blocking_save_copy_s",
    "blocking_save_overlap_s",
    "save_total_s",
    "save_total_overlap_s",
    "ours_overlapped_fwd_bwd_s",
    "ours_overlap_fwd_bwd_s",
    "dcp_save_s",
    "dcp_async_save_blocking_s",
    "dcp_async_save_writer_stager_s",
    "dcp_async_save_default_stager_s",
    "dcp_async_save_default_stager_staging_s",
    "dcp_load_s",
    "restore_disk_s",
    "in_process_rollback_s",
    "relaunch_s",
    "memcpy_s",
    "fwd_bwd_s",
}


@pytest.mark.e2e
@pytest.mark.slow
def test_sharded_bench_at_two_ranks_writes_every_key(tmp_path):
    """About 15-25 s: one measuring torchrun and one relaunch torchrun of 2 ranks each."""
    out = tmp_path / "sharded.json"
    args = ["bench", "checkpoint", "--sharded", "--world-size", "2", "--params", "2M", "--reps", "1"]
    assert main([*args, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["sharded"], r["world_size"], r["reps"], r["device"]) == (True, 2, 1, "cpu")
    assert TIMES <= r.keys() and all(r[k] > 0 for k in TIMES), {k: r.get(k) for k in TIMES}
    assert all(len(r["reps_s"][k]) == 1 and r["reps_s"][k][0] == r[k] for k in TIMES)
    assert r["save_total_s"] >= r["blocking_save_copy_s"]
    assert r["save_total_overlap_s"] >= r["blocking_save_overlap_s"]
    # our headline is the faster of our two ways, and the JSON names it
    ways = {"copy": r["blocking_save_copy_s"], "overlap": r["blocking_save_overlap_s"]}
    assert r["blocking_save_s"] == min(ways.values()) == ways[r["blocking_save_variant"]]
    assert r["dcp_async_save_blocking_s"] == r[f"dcp_async_save_{r['dcp_async_save_variant']}_s"]
    # About 2M parameters, and AdamW's two moments: about 3 x 4 bytes a parameter, half on each rank.
    assert 1.5e6 < r["params"] < 2.5e6 and 11 * r["params"] < r["state_bytes"] < 13 * r["params"]
    ranks = r["per_rank"]
    assert [p["rank"] for p in ranks] == [0, 1]
    assert sum(p["local_state_bytes"] for p in ranks) == r["state_bytes"]
    for p in ranks:  # every rank wrote its own half (new bytes every rep: no dedup), plus headers
        assert 0.45 < p["bytes_written"] / r["state_bytes"] < 0.55, p
        assert p["write_s"] > 0 and p["write_throughput_mb_s"] > 0
    assert (
        set(r["targets"])
        == set(TARGETS)
        == {
            "blocking_vs_async_save",
            "blocking_vs_dcp_save",
            "restore_vs_dcp_load",
            "in_process_vs_relaunch",
        }
    )
    for name, (num, den, goal) in TARGETS.items():
        t = r["targets"][name]
        assert t["value"] == pytest.approx(r[num] / r[den]) and t["target"] == goal
        assert t["met"] is (t["value"] <= goal)
    # The relaunch restored the last commit bit for bit, and its clock readings come in order.
    assert r["relaunch_restored_bit_exact"] is True
    phases = list(r["relaunch_phases_s"].values())
    assert len(phases) == 4 and 0 < phases[0] and phases == sorted(phases) and phases[-1] < r["relaunch_s"]
    # The JSON says which of our paths it measured.
    assert r["paths_measured"]["blocking_save_s"].startswith("the faster of our async save's ways")
    assert r["paths_measured"]["in_process_rollback_s"].startswith("restore_memory")
    # the ring held the checkpoint on every rank: no rep went to disk
    assert r["paths_measured"]["in_process_rollback_s"].endswith("0 of 1 went to disk instead")
    assert r["paths_measured"]["restore_verify"] == "full"
    assert {"start", "end"} == set(r["load_average_1m"]) and r["machine"]["cpus"] >= 1
    assert [p.name for p in tmp_path.iterdir()] == ["sharded.json"]  # the scratch directory is gone


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sharded", "--world-size", "1"], "--world-size: expected at least 2 ranks"),
        (["--world-size", "2"], "only a --sharded run has ranks; add --sharded"),
        (["--sharded", "--device", "tpu"], "--device: expected cpu or cuda, got 'tpu'"),
        (["--sharded", "--params", "lots"], "--params: expected a count like 10M"),
    ],
)
def test_bad_sharded_options_exit_2_with_the_option_named(args, message, capsys, tmp_path):
    assert main(["bench", "checkpoint", *args, "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")
def test_sharded_cuda_without_gpus_is_refused_before_anything_starts(capsys, tmp_path):
    args = ["bench", "checkpoint", "--sharded", "--device", "cuda", "--workdir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--device cuda: expected a CUDA GPU per rank (2), found 0" in err and "--device cpu" in err
    assert list(tmp_path.iterdir()) == []
