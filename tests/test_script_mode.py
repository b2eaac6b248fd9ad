"""Script mode's parts (issue 16, part 3): the output parser, the relaunch template, the `script:` policy section
and its errors, `policy explain`, and the versioning of a script's own checkpoint files into our store."""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies import PolicyError, parse_policy
from policies.summary import summarize
from supervisor.checkpoint import open_store
from supervisor.checkpoint.blobs import tensor_digest
from supervisor.checkpoint.retention import policy_from_settings
from supervisor.cli import main
from supervisor.errors import CheckpointCorrupt, CheckpointError
from supervisor.launcher import LaunchSpec, LocalLauncher
from supervisor.monitor import DetectorSet, build_detectors
from supervisor.runtime.plan import RestoreSpec
from supervisor.script import opaque
from supervisor.script.files import PENDING_SCANS, ScriptFiles, glob_regex
from supervisor.script.first_save import FirstSave
from supervisor.script.mode import ScriptMode, SegmentPaths
from supervisor.script.output import OutputParser, Parsed, pattern_problem
from supervisor.script.scanner import ExitWatch, FileScanner
from supervisor.script.steps import NameStep, OutputStep, SidecarStep
from supervisor.script.tap import DUPLICATE_WINDOW_S, OutputTap
from supervisor.script.template import ArgTemplate, TemplateError
from supervisor.script.watch import ScriptWatcher
from supervisor.spool import SpoolReader, SpoolWriter
from tests.conftest import REPO

SCRIPT_POLICY = REPO / "tests" / "data" / "policies" / "script.yaml"
NANOGPT = r"iter (?P<step>\d+): loss (?P<loss>[^,\s]+)"

# -- the output parser ------------------------------------------------------------------------------------

PARSE_CASES = [
    # (line, expected)
    ("iter 120: loss 3.2102, time 51.3ms, mfu 12.1%", Parsed(120, {"loss": 3.2102})),
    ("iter 7: loss nan, time 50ms", None),  # checked below: NaN compares unequal
    ("iter 8: loss inf", Parsed(8, {"loss": math.inf})),
    ("step 500: train loss 2.9, val loss 3.1", Parsed(500, {"train_loss": 2.9, "val_loss": 3.1})),
    ("iter 9: loss 12ms", Parsed(9, {})),  # a group that does not read as a number is left out
    ("saving checkpoint to out", None),
    ("iteration 3: loss 1.0", None),
]


@pytest.mark.parametrize(("line", "expected"), PARSE_CASES)
def test_the_parser_reads_step_and_metrics(line, expected):
    parser = OutputParser(
        [NANOGPT, r"step (?P<step>\d+): train loss (?P<train_loss>\S+), val loss (?P<val_loss>\S+)"]
    )
    parsed = parser.parse(line)
    if "nan" in line:
        assert parsed.step == 7 and math.isnan(parsed.metrics["loss"]) and not parsed.finite
    else:
        assert parsed == expected


def test_the_first_matching_pattern_wins_and_metrics_are_named_by_groups():
    parser = OutputParser([r"(?P<step>\d+) a=(?P<a>\S+)", r"(?P<step>\d+) a=(?P<b>\S+)"])
    assert parser.parse("4 a=1.5") == Parsed(4, {"a": 1.5})
    assert parser.metrics == {"a", "b"}


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        (NANOGPT, None),
        (r"iter (\d+): loss (?P<loss>\S+)", "has no named group `step`"),
        (r"iter (?P<step>\d+: loss", "is not a valid regular expression"),
    ],
)
def test_pattern_problems(pattern, problem):
    found = pattern_problem(pattern)
    assert (found is None) if problem is None else found.startswith(problem)


# -- the relaunch template --------------------------------------------------------------------------------

FIELDS = {"checkpoint": "out/ckpt.pt", "step": 1200, "lr_scale": 0.25, "skip_batches": 7, "lr": 6e-4}

RENDER_CASES = [
    ("--init_from=resume --learning_rate={lr * lr_scale}", ["--init_from=resume", "--learning_rate=0.00015"]),
    (["--lr={lr*lr_scale:.2e}"], ["--lr=1.50e-04"]),
    (
        ["--skip={skip_batches}", "--step={step}", "--ckpt={checkpoint}"],
        ["--skip=7", "--step=1200", "--ckpt=out/ckpt.pt"],
    ),
    (["--lr={2 * lr_scale}"], ["--lr=0.5"]),
    (["--lr={8 * lr_scale}"], ["--lr=2.0"]),  # a float stays a float: nanoGPT refuses --learning_rate=2
    (["--every={2 * step}"], ["--every=2400"]),
    (['--json={{"a": {step}}}'], ['--json={"a": 1200}']),
    ("--note='two words' --x={ lr }", ["--note=two words", "--x=0.0006"]),
    ([], []),
]


@pytest.mark.parametrize(("args", "expected"), RENDER_CASES)
def test_the_template_renders_products_of_named_values(args, expected):
    assert ArgTemplate.parse(args, {"lr": 6e-4}).render(FIELDS) == expected


def test_the_template_knows_which_fields_it_uses():
    template = ArgTemplate.parse("--init_from=resume --learning_rate={lr * lr_scale}", {"lr": 1.0})
    assert template.fields == {"lr", "lr_scale"}


TEMPLATE_ERRORS = [
    # (args, item, words in the error)
    (["--lr={lrr * lr_scale}"], 0, "unknown name 'lrr'"),
    (["--a", "--lr={lr!r}"], 1, "without a conversion"),
    (["--lr={lr.real}"], 0, "a name or a product"),
    (["--lr={lr + 1}"], 0, "a name or a product"),
    (["--lr={__import__('os')}"], 0, "a name or a product"),
    (["--c={checkpoint * 2}"], 0, "cannot be multiplied"),
    (["--s={step:.3q}"], 0, "a format spec for a int"),
    (["--s={step"], 0, "balanced braces"),
    ("--s='{step}", None, "quoted as a shell would"),
]


@pytest.mark.parametrize(("args", "item", "words"), TEMPLATE_ERRORS)
def test_the_template_refuses_anything_but_names_and_products(args, item, words):
    with pytest.raises(TemplateError) as err:
        ArgTemplate.parse(args, {"lr": 1.0})
    assert err.value.item == item and words in str(err.value)


# -- the policy section and its errors ---------------------------------------------------------------------

BASE = """\
version: 1
name: s
rules:
  - when: [divergence]
    action: rollback
    target: {select: before, lookback_steps: 50}
    skip_batches: 5
    lr_scale: 0.5
script:
"""

SCHEMA_ERRORS = [
    (
        "  output: {patterns: ['iter (\\d+): loss (?P<loss>\\S+)']}\n  checkpoints: {glob: out/ckpt.pt}\n",
        ":10:23: script.output.patterns[0]: expected a regular expression with a named group `step` "
        "(this one has no named group `step`",
    ),
    (
        "  output: {patterns: ['iter (?P<step>\\d+: loss']}\n  checkpoints: {glob: out/ckpt.pt}\n",
        ":10:23: script.output.patterns[0]: expected a regular expression with a named group `step` "
        "(this one is not a valid regular expression",
    ),
    (
        "  checkpoints: {glob: out/ckpt.pt}\n",
        ":10:16: script.checkpoints.step_from: expected name or sidecar when output.patterns is empty",
    ),
    (
        f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: ../out/ckpt.pt}}\n",
        ":11:23: script.checkpoints.glob: expected a glob relative to the working directory, without `..`, "
        'got "../out/ckpt.pt"',
    ),
    (
        f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: out/ckpt.pt}}\n"
        "  relaunch: {args: ['--init_from=resume', '--learning_rate={lrr * lr_scale}'], values: {lr: 1.0}}\n",
        ":12:43: script.relaunch.args[1]: expected a field naming one of checkpoint, lr, lr_scale, skip_batches, "
        "step, got {lrr * lr_scale} (unknown name 'lrr')",
    ),
    (
        f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: out/ckpt.pt}}\n"
        "  relaunch: {args: '--learning_rate={lr * lr_scale}', values: {lr: 6e-4}}\n",
        ":12:68: script.relaunch.values.lr: expected a number (YAML needs a dot in 6.0e-4; 6e-4 is a string), "
        'got "6e-4"',
    ),
    (
        f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: 'c/*.pt', step_from: name}}\n",
        ":11:16: script.checkpoints.step_pattern: expected a regular expression with a named group `step` "
        "for step_from: name",
    ),
    (
        "  checkpoints: {glob: out/meta.txt, step_from: sidecar, sidecar: out/meta.txt, expect_within_steps: 50}\n",
        ":10:101: script.checkpoints.expect_within_steps: expected null when output.patterns is empty (no step is "
        "read from the output to compare with it), got 50",
    ),
    (
        f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: out/ckpt.pt, warn_after_seconds: 0}}\n",
        ":11:56: script.checkpoints.warn_after_seconds: expected a number > 0 or null, got 0",
    ),
]


@pytest.mark.parametrize(("section", "message"), SCHEMA_ERRORS)
def test_a_bad_script_section_names_file_line_key_expected_and_found(section, message):
    with pytest.raises(PolicyError) as err:
        parse_policy(BASE + section, "p.yaml")
    assert str(err.value).startswith("p.yaml" + message), str(err.value)


def test_run_refuses_a_bad_script_section_in_one_line_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text(BASE + SCHEMA_ERRORS[0][0])
    assert (
        main(["run", "--policy", str(bad), "--workdir", str(tmp_path / "w"), "--", "python", "train.py"]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}:10:23: script.output.patterns[0]: expected") and err.count("\n") == 1
    assert "Traceback" not in err and not (tmp_path / "w").exists()


def test_explain_says_which_rule_keys_the_script_cannot_honour():
    policy = parse_policy(
        BASE + f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: out/ckpt.pt}}\n"
        "  relaunch: {args: '--init_from=resume --learning_rate={lr * lr_scale}', values: {lr: 6.0e-4}}\n"
    )
    text = summarize(policy)
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("divergence")]
    assert "skip 5 batches (unsupported: script.relaunch.args has no {skip_batches}" in line
    assert "scale the learning rate by 0.5." in line  # {lr_scale} is in the template: supported
    assert (
        "Relaunch: the command plus --init_from=resume --learning_rate={lr * lr_scale} (lr = 0.0006)" in text
    )
    assert "Not used in script mode (the script decides when it saves): checkpoint.every_steps" in text


def test_the_test_policy_explains_through_the_cli(capsys):
    assert main(["policy", "explain", str(SCRIPT_POLICY)]) == 0
    out = capsys.readouterr().out
    assert "skip 7 batches (unsupported" in out and "Script mode" in out


# -- the output tap and the watcher ------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_tap_spools_queues_and_times_each_step(tmp_path):
    clock, lines = Clock(), []
    tap = OutputTap(
        OutputParser([NANOGPT]),
        spool=SpoolWriter(tmp_path / "0.jsonl"),
        start_step=40,
        then=lambda stream, line: lines.append(line),
        clock=clock,
    )
    assert tap.step_at(99.0) == 40  # before any line: the step the segment started from
    for step in (41, 42):
        clock.now += 1
        tap("stdout", f"iter {step}: loss {step / 10}")
    tap("stderr", "a warning")
    assert [tap.step_at(t) for t in (100.5, 101.0, 101.5, 102.0, 500.0)] == [40, 41, 41, 42, 42]
    assert [r.parsed.step for r in tap.take()] == [41, 42] and tap.take() == []
    assert tap.latest() == {"loss": 4.2} and lines == ["iter 41: loss 4.1", "iter 42: loss 4.2", "a warning"]
    tap.close()
    points, _ = SpoolReader(tmp_path / "0.jsonl").pending(10)
    assert points == [("loss", 4.1, 101000, 41), ("loss", 4.2, 102000, 42)]


def test_a_step_every_rank_prints_is_counted_once_and_a_restarts_reprint_again(tmp_path, caplog):
    """Two ranks that both print each step (a script that does not guard its prints), lines interleaved and one
    rank a line behind: every step reaches the spool, the detectors and the timeline once, from the first line
    read; an eval line at the same step (other metric names) still counts; a step printed again after the
    window (the script's own restart) counts again."""
    clock = Clock()
    eval_line = r"step (?P<step>\d+): val (?P<val_loss>\S+)"
    tap = OutputTap(OutputParser([NANOGPT, eval_line]), spool=SpoolWriter(tmp_path / "0.jsonl"), clock=clock)
    printed = ["iter 1: loss 1.0", "iter 2: loss 2.0", "iter 1: loss 1.5", "iter 3: loss 3.0", "iter 2: loss 2.5",
               "step 3: val 0.9", "iter 3: loss 3.5"]  # fmt: skip
    for line in printed:
        clock.now += 0.01
        tap("stdout", line)
    taken = [(r.parsed.step, r.parsed.metrics) for r in tap.take()]
    assert taken == [(1, {"loss": 1.0}), (2, {"loss": 2.0}), (3, {"loss": 3.0}), (3, {"val_loss": 0.9})]
    assert tap.duplicates == 3 and tap.metrics_at(3) == {"loss": 3.0, "val_loss": 0.9}
    assert caplog.text.count("printed again with the same metrics (loss)") == 1  # said once, with the fix
    assert "print metrics on rank 0 only" in caplog.text
    clock.now += DUPLICATE_WINDOW_S + 1
    tap("stdout", "iter 2: loss 2.25")  # the script restarted from step 2 by itself: a new point
    assert [(r.parsed.step, r.parsed.metrics) for r in tap.take()] == [(2, {"loss": 2.25})]
    tap.close()
    points, _ = SpoolReader(tmp_path / "0.jsonl").pending(10)
    assert [(name, value, step) for name, value, _, step in points] == [
        ("loss", 1.0, 1), ("loss", 2.0, 2), ("loss", 3.0, 3), ("val_loss", 0.9, 3), ("loss", 2.25, 2)
    ]  # fmt: skip


def test_the_watcher_sees_what_was_printed_after_its_last_poll(tmp_path):
    tap = OutputTap(OutputParser([NANOGPT]))
    watcher = ScriptWatcher(tap, DetectorSet(build_detectors([{"type": "non_finite", "metrics": ["loss"]}])))
    tap("stdout", "iter 1: loss 2.0")
    assert watcher.poll(1.0) == [] and watcher.last_step == 1
    tap("stdout", "iter 2: loss nan")  # the script printed this, then exited before the next poll
    event = watcher.leftover(2.0)
    assert (event.type, event.onset_step, watcher.last_step) == ("non_finite", 2, 2)


# -- versioning the script's files -------------------------------------------------------------------------


def _save(path: Path, value: float, iter_num: int) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.full((256,), value), "iter_num": iter_num}, path)
    return path.read_bytes()


def _files(tmp_path: Path, step: list[int], **kw) -> ScriptFiles:
    kw.setdefault("settle_seconds", 0.0)
    kw.setdefault("zip_check", True)
    return ScriptFiles(
        tmp_path / "run", "out/ckpt.pt", tmp_path / "store", OutputStep(lambda when: step[0]), **kw
    )


def test_a_changed_file_is_versioned_once_settled_and_an_unchanged_one_is_not(tmp_path):
    step, clock = [0], Clock(1e12)  # a clock far after every mtime: everything has settled
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, step, clock=clock) as files:
        first = _save(ckpt, 1.0, 10)
        step[0] = 10
        assert files.scan() == []  # seen once: it may still be written
        (v10,) = files.scan(metrics={"loss": 0.5})
        _save(ckpt, 1.0, 10)  # the same bytes written again: a new mtime, nothing new to keep
        assert files.scan() == [] and files.scan() == []
        step[0] = 20
        _save(ckpt, 2.0, 20)
        assert files.scan() == []
        (v20,) = files.scan(metrics={"loss": float("nan")})
        infos = files.catalog.list()
    assert [(i.id, i.step) for i in infos] == [(v10, 10), (v20, 20)]
    assert infos[0].metrics == {"loss": 0.5} and infos[0].healthy and not infos[1].healthy
    catalog = open_store(tmp_path / "store")
    assert catalog.verify(v10, "full") is None and catalog.verify(v20, "full") is None
    manifest = catalog.manifest(v10)
    (ref,) = manifest.tensors.values()
    assert ref.key == "out/ckpt.pt" and (ref.dtype, ref.shape) == ("U8", (len(first),))
    assert ref.digest == tensor_digest(torch.frombuffer(bytearray(first), dtype=torch.uint8))


def test_identical_bytes_are_stored_once(tmp_path):
    step = [10]
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, step) as files:
        one = _save(ckpt, 1.0, 10)
        (a,) = files.scan(final=True)
        _save(ckpt, 2.0, 20)
        step[0] = 20
        (b,) = files.scan(final=True)
        ckpt.write_bytes(one)  # the script went back to the first state (a new file, the same bytes)
        step[0] = 30
        (c,) = files.scan(final=True)
    catalog = open_store(tmp_path / "store")
    blobs = {cid: next(iter(catalog.manifest(cid).tensors.values())).blob for cid in (a, b, c)}
    assert blobs[a] == blobs[c] != blobs[b] and len(catalog.blob_files()) == 2
    assert catalog.manifest(c).written_bytes == 0


def test_a_file_still_changing_or_cut_short_is_not_versioned(tmp_path):
    step, clock = [5], Clock(0.0)
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, step, clock=clock, settle_seconds=2.0) as files:
        whole = _save(ckpt, 1.0, 5)
        clock.now = ckpt.stat().st_mtime + 1.0
        assert files.scan() == [] and files.scan() == []  # unchanged, but not yet 2 s old
        clock.now += 1.5
        (good,) = files.scan()
        ckpt.write_bytes(whole[: len(whole) // 2])  # a save cut short by a kill
        clock.now += 10
        assert files.scan() == [] and files.scan() == [] and files.scan(final=True) == []
        assert [i.id for i in files.catalog.list()] == [good]


def test_a_restore_puts_an_older_version_back_byte_identical_and_abandons_later_ones(tmp_path):
    step = [10]
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, step) as files:
        old = _save(ckpt, 1.0, 10)
        (v10,) = files.scan(final=True)
        step[0] = 20
        _save(ckpt, 2.0, 20)
        (v20,) = files.scan(final=True)
    inode = ckpt.stat().st_ino
    with _files(tmp_path, [0]).open(baseline=False) as files:
        restored = files.restore(v10, rollback=True)
        abandoned = files.catalog.abandoned_ids()
    assert (restored.id, restored.step, restored.files) == (v10, 10, ("out/ckpt.pt",))
    assert ckpt.read_bytes() == old and ckpt.stat().st_ino != inode  # renamed into place, not rewritten
    state = torch.load(io.BytesIO(old), weights_only=True)
    assert torch.equal(torch.load(ckpt, weights_only=True)["w"], state["w"])
    assert abandoned == {v20} and not list(ckpt.parent.glob("*tmp"))
    assert open_store(tmp_path / "store").latest().id == v10


def test_a_restore_of_a_damaged_version_leaves_the_file_in_place(tmp_path):
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, [10]) as files:
        _save(ckpt, 1.0, 10)
        (v10,) = files.scan(final=True)
    blob = tmp_path / "store" / next(iter(open_store(tmp_path / "store").manifest(v10).tensors.values())).blob
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF
    blob.write_bytes(bytes(raw))
    newer = _save(ckpt, 3.0, 30)
    with (
        _files(tmp_path, [0]).open(baseline=False) as files,
        pytest.raises(CheckpointCorrupt, match="reads back"),
    ):
        files.restore(v10)
    assert ckpt.read_bytes() == newer and not list(ckpt.parent.glob("*tmp"))


def test_a_version_never_writes_outside_the_glob(tmp_path):
    root = tmp_path / "run"
    wide = ScriptFiles(
        root, "**/*.pt", tmp_path / "store", NameStep(r"_(?P<step>\d+)\.pt$"), settle_seconds=0
    )
    with wide:
        _save(root / "elsewhere" / "m_10.pt", 1.0, 10)
        (cid,) = wide.scan(final=True)
    narrow = ScriptFiles(root, "ckpts/*.pt", tmp_path / "store", NameStep(r"_(?P<step>\d+)\.pt$"))
    with narrow.open(baseline=False), pytest.raises(CheckpointCorrupt, match="does not match"):
        narrow.restore(cid)


def test_steps_from_names_version_each_step_and_a_restore_removes_newer_files(tmp_path):
    root = tmp_path / "run"
    files = ScriptFiles(
        root, "ckpts/*.pt", tmp_path / "store", NameStep(r"step_(?P<step>\d+)\.pt$"), settle_seconds=0
    )
    with files:
        first = _save(root / "ckpts" / "step_10.pt", 1.0, 10)
        _save(root / "ckpts" / "step_20.pt", 2.0, 20)
        (root / "ckpts" / "notes.pt").write_bytes(b"not a checkpoint")  # matches the glob, not the pattern
        v10, v20 = files.scan(final=True)
        (root / "ckpts" / "step_10.pt").unlink()
        restored = files.restore(v10, rollback=True)
    assert [(i.id, i.step) for i in open_store(tmp_path / "store").list()] == [(v10, 10), (v20, 20)]
    assert restored.files == ("ckpts/step_10.pt",)
    assert (root / "ckpts" / "step_10.pt").read_bytes() == first
    assert sorted(p.name for p in (root / "ckpts").iterdir()) == ["notes.pt", "step_10.pt"]


def test_a_restore_moves_a_newer_file_the_store_lacks_aside_instead_of_deleting_it(tmp_path):
    """Nothing is lost: step_30.pt was written after the last scan (never versioned), so the rollback moves it
    under the store's aside/ directory, byte-identical; step_20.pt, which the store holds, is removed."""
    root, store = tmp_path / "run", tmp_path / "store"
    files = ScriptFiles(root, "ckpts/*.pt", store, NameStep(r"step_(?P<step>\d+)\.pt$"), settle_seconds=0)
    with files:
        _save(root / "ckpts" / "step_10.pt", 1.0, 10)
        _save(root / "ckpts" / "step_20.pt", 2.0, 20)
        v10, _ = files.scan(final=True)
        unversioned = _save(root / "ckpts" / "step_30.pt", 3.0, 30)
        files.restore(v10, rollback=True)
    assert sorted(p.name for p in (root / "ckpts").iterdir()) == ["step_10.pt"]
    (aside,) = (p for p in (store / "aside").rglob("*") if p.is_file())
    assert aside.name == "step_30.pt" and aside.read_bytes() == unversioned
    assert aside.relative_to(store / "aside").parts[0].startswith(v10)
    assert [i.step for i in open_store(store).list()] == [10, 20]  # the aside file is no checkpoint


def test_a_sidecar_names_the_step(tmp_path):
    root = tmp_path / "run"
    files = ScriptFiles(
        root,
        "out/*",
        tmp_path / "store",
        SidecarStep(root / "out" / "meta.json", "iter_num"),
        settle_seconds=0,
    )
    with files:
        _save(root / "out" / "model.pt", 1.0, 0)
        assert files.scan(final=True) == []  # no sidecar yet: its step cannot be told
        (root / "out" / "meta.json").write_text(json.dumps({"iter_num": 300}))
        (cid,) = files.scan(final=True)
        manifest = files.catalog.manifest(cid)
    assert manifest.step == 300 and sorted(manifest.tensors) == ["out/meta.json", "out/model.pt"]


def test_retention_keeps_the_newest_and_deletes_the_rest_with_their_blobs(tmp_path):
    step = [0]
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, step, retention=policy_from_settings(keep_last=2)) as files:
        ids = []
        for i in range(1, 5):
            step[0] = 10 * i
            _save(ckpt, float(i), 10 * i)
            ids += files.scan(final=True)
    catalog = open_store(tmp_path / "store")
    assert [i.id for i in catalog.list()] == ids[-2:] and len(catalog.blob_files()) == 2


# A crash between staging and the commit marker: the process dies at the gate (SIGKILL, nothing cleans up).
CRASH = """
import os, signal, sys
from pathlib import Path
from supervisor.script.files import ScriptFiles
from supervisor.script.steps import OutputStep
tmp = Path(sys.argv[1])
files = ScriptFiles(tmp / "run", "out/ckpt.pt", tmp / "store", OutputStep(lambda when: 20), settle_seconds=0).open()
os.replace(tmp / "new.pt", tmp / "run" / "out" / "ckpt.pt")  # the script saves while we watch
files.before_commit = lambda: os.kill(os.getpid(), signal.SIGKILL)
files.scan(final=True)
"""


def test_a_commit_cut_short_leaves_the_old_version(tmp_path):
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, [10]) as files:
        old = _save(ckpt, 1.0, 10)
        (v10,) = files.scan(final=True)
    new = _save(tmp_path / "new.pt", 2.0, 20)
    died = subprocess.run(
        [sys.executable, "-c", CRASH, str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert died.returncode == -signal.SIGKILL, died.stderr
    staged = os.listdir(tmp_path / "store" / ".tmp")
    assert len(staged) == 1 and staged[0].startswith("0000000020-000002")  # the copy was made, not committed
    assert [i.id for i in open_store(tmp_path / "store").list()] == [v10]
    with _files(tmp_path, [0]).open(baseline=False) as files:  # opening cleans up what the crash left
        assert os.listdir(tmp_path / "store" / ".tmp") == []
        assert files.catalog.verify(v10, "full") is None and len(files.catalog.blob_files()) == 1
        files.restore(v10)
    assert ckpt.read_bytes() == old != new


def test_glob_regex_matches_what_path_glob_matches(tmp_path):
    for rel in ("out/ckpt.pt", "out/a/b/ckpt.pt", "ckpt.pt", "out/ckpt.pth", "out/.ckpt.pt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    for pattern in (
        "out/ckpt.pt",
        "out/*.pt",
        "**/ckpt.pt",
        "out/**/*.pt",
        "*.pt",
        "out/ckpt.p[t]",
        "out/?kpt.pt",
    ):
        globbed = {p.relative_to(tmp_path).as_posix() for p in tmp_path.glob(pattern) if p.is_file()}
        regex = glob_regex(pattern)
        matched = {
            rel
            for rel in ("out/ckpt.pt", "out/a/b/ckpt.pt", "ckpt.pt", "out/ckpt.pth", "out/.ckpt.pt")
            if regex.match(rel)
        }
        assert matched == globbed, pattern


def test_the_opaque_digest_is_the_stores_tensor_digest(tmp_path):
    data = os.urandom(100_003)
    (tmp_path / "f").write_bytes(data)
    digest, size = opaque.file_digest(tmp_path / "f")
    assert size == len(data) and digest == tensor_digest(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def test_the_nanogpt_example_policy_loads_and_honours_every_key_it_sets(capsys):
    example = REPO / "examples" / "script_mode" / "nanogpt.yaml"
    assert main(["policy", "explain", str(example)]) == 0
    out = capsys.readouterr().out
    assert "unsupported" not in out.lower()
    assert "scale the learning rate by 0.5" in out and "Relaunch: the command plus --init_from=resume" in out
    # The command in the header saves where the glob looks (the config's own out_dir is out-shakespeare-char).
    text = example.read_text()
    (out_dir,) = set(re.findall(r"--out_dir=(\w+)", text.split("version: 1")[0]))
    glob = parse_policy(text, str(example)).script.checkpoints.glob
    assert glob_regex(glob).match(f"{out_dir}/ckpt.pt")


# -- review fixes: own files, torn saves, MLflow variables, sidecars, stalls, metrics at a version's step ------

OWN_FILES_POLICY = f"""\
version: 1
name: own
rules:
  - when: [unknown_exit]
    action: resume
script:
  output: {{patterns: ['{NANOGPT}']}}
  checkpoints: {{glob: '**/*.safetensors', settle_seconds: 0}}
"""


def test_the_supervisors_own_files_are_never_versioned_and_a_restore_touches_none(tmp_path):
    """A `**` glob, with run's default work directory (.rollback) under the script's working directory."""
    root, workdir = tmp_path / "run", tmp_path / "run" / ".rollback"
    lineage, store = workdir / "lineages" / "L", workdir / "checkpoints" / "L"
    policy = parse_policy(OWN_FILES_POLICY, "p.yaml")
    mode = ScriptMode(policy, "p.yaml", store, cwd=str(root), exclude=(workdir,))  # as the runner passes it
    paths = SegmentPaths(lineage / "metrics" / "0.jsonl", lineage / "heartbeat.json", lineage / "faults.json")
    mode._exclude_own(paths, {"MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db"})
    own = [
        lineage / "x.safetensors",
        workdir / "mlartifacts" / "y.safetensors",
        workdir / "mlflow.db.safetensors",
    ]
    for path in own:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"ours")
    model = root / "model.safetensors"
    files = mode._files(mode._steps(None))
    files._clock = Clock(1e12)
    with files:
        ids = []
        for value in (1.0, 2.0):
            _save(model, value, 0)
            for _ in range(3):  # a scan never versions the blobs the previous one wrote into the store
                ids += files.scan()
        assert len(ids) == 2 and set(files.matches()) == {"model.safetensors"}
        blobs = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
        assert any(p.suffix == ".safetensors" for p in blobs)
        # A snapshot restore removes the matched files newer than the version: none of the store's.
        files.restore(ids[0], rollback=True)
    stored = {p: raw for p, raw in blobs.items() if p.suffix == ".safetensors"}
    assert {p: p.read_bytes() for p in stored} == stored
    assert all(p.read_bytes() == b"ours" for p in own)
    catalog = open_store(store)
    assert [sorted(catalog.manifest(i).tensors) for i in ids] == [["model.safetensors"]] * 2


TORN_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
store, ckpt = Path(sys.argv[1]), Path("ckpt.bin")
ckpt.write_bytes(b"A" * 100_000)  # a whole save
while not any(store.glob("ckpt-*")):  # until the supervisor has versioned it
    time.sleep(0.01)
with open(ckpt, "wb") as f:  # the next save, in place, cut short by a kill
    f.write(b"B" * 5000)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_in_the_middle_of_a_write_leaves_the_previous_version_latest(tmp_path):
    root, store = tmp_path / "run", tmp_path / "store"
    root.mkdir()
    files = ScriptFiles(root, "*.bin", store, OutputStep(lambda when: 7), settle_seconds=0.05)  # opaque
    watch = ExitWatch(LocalLauncher())
    scanner = FileScanner(files.open(), 0.02, lambda step: {}, clean=watch.clean)
    handle = watch.start(LaunchSpec((sys.executable, "-c", TORN_SCRIPT, str(store)), cwd=str(root)))
    scanner.start()
    info = handle.wait(timeout=60)
    scanner.drain()  # the final scan, after the kill: the torn file changed since the last scan
    assert info.returncode == -signal.SIGKILL and not watch.clean()
    catalog = open_store(store)
    (only,) = catalog.list()
    out = tmp_path / "restored"
    with open(out, "wb") as f:
        ref = catalog.manifest(only.id).tensors["ckpt.bin"]
        opaque.read_blob(catalog.confined(ref.blob), ref.key, f.fileno())
    assert out.read_bytes() == b"A" * 100_000 and (root / "ckpt.bin").read_bytes() == b"B" * 5000
    # The same final scan after a clean exit versions what the script left (so the test above can fail).
    with ScriptFiles(root, "*.bin", store, OutputStep(lambda when: 8), settle_seconds=60) as again:
        assert again.scan(final=True, clean=False) == [] and len(again.scan(final=True, clean=True)) == 0
        (root / "ckpt.bin").write_bytes(b"C" * 10)
        assert again.scan(final=True, clean=False) == [] and len(again.scan(final=True)) == 1


@pytest.mark.parametrize(
    ("checkpoints", "expected"),
    [
        ("{glob: out/ckpt.pt}", "zip"),
        ("{glob: 'out/*.pth'}", "zip"),
        ("{glob: 'lightning_logs/**/*.ckpt'}", "zip"),
        ("{glob: 'out/*.bin'}", "opaque"),
        ("{glob: out/ckpt.pt, format: opaque}", "opaque"),
    ],
)
def test_format_defaults_to_zip_for_torch_save_suffixes(checkpoints, expected):
    section = f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {checkpoints}\n"
    assert parse_policy(BASE + section, "p.yaml").script.checkpoints.file_format() == expected


def _segment_env(tmp_path: Path, section: str) -> dict[str, str]:
    mode = ScriptMode(parse_policy(BASE + section, "p.yaml"), "p.yaml", tmp_path / "store", cwd=str(tmp_path))
    lineage = tmp_path / "w" / "lineages" / "L"
    paths = SegmentPaths(lineage / "0.jsonl", lineage / "heartbeat.json", lineage / "faults.json")
    env = {
        "MLFLOW_TRACKING_URI": "sqlite:////nowhere/mlflow.db",
        "MLFLOW_EXPERIMENT_ID": "1",
        "MLFLOW_RUN_ID": "r",
    }
    return mode.segment(0, RestoreSpec(), ("python", "t.py"), paths, env, None).env


def test_the_mlflow_variables_are_exported_only_with_script_mlflow_join(tmp_path):
    with_patterns = f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: out/ckpt.pt}}\n"
    without = "  checkpoints: {glob: 'c/step_*.pt', step_from: name, step_pattern: 'step_(?P<step>\\d+)'}\n"
    assert _segment_env(tmp_path, with_patterns) == {}  # default off: set_experiment and log_param stay safe
    joined = {
        "MLFLOW_TRACKING_URI": "sqlite:////nowhere/mlflow.db",
        "MLFLOW_EXPERIMENT_ID": "1",
        "MLFLOW_RUN_ID": "r",
    }
    assert _segment_env(tmp_path, without) == joined  # default join: the script's MLflow is the only source
    assert _segment_env(tmp_path, with_patterns + "  mlflow: join\n") == joined
    assert _segment_env(tmp_path, without + "  mlflow: 'off'\n") == {}
    assert _segment_env(tmp_path, without + "  mlflow: off\n") == {}  # YAML's false


def test_a_sidecar_is_never_zip_checked(tmp_path):
    root = tmp_path / "run"
    sidecar = SidecarStep(root / "out" / "meta.json", "iter_num")
    with ScriptFiles(
        root, "out/*", tmp_path / "store", sidecar, settle_seconds=0, zip_check=True, sidecar="out/meta.json"
    ) as files:
        _save(root / "out" / "model.pt", 1.0, 0)
        (root / "out" / "meta.json").write_text(json.dumps({"iter_num": 40}))
        (cid,) = files.scan(final=True)
        (root / "out" / "model.pt").write_bytes(b"torn")  # the checkpoint itself is still checked
        (root / "out" / "meta.json").write_text(json.dumps({"iter_num": 50}))
        assert files.scan(final=True) == []
    assert sorted(open_store(tmp_path / "store").manifest(cid).tensors) == ["out/meta.json", "out/model.pt"]


def test_a_sidecar_the_glob_does_not_match_is_a_policy_error_with_exit_2(tmp_path, capsys):
    section = "  checkpoints: {glob: 'out/*.pt', step_from: sidecar, sidecar: out/meta.json, sidecar_key: iter_num}\n"
    with pytest.raises(PolicyError) as err:
        parse_policy(BASE + section, "p.yaml")
    assert str(err.value).startswith(
        "p.yaml:10:64: script.checkpoints.sidecar: expected a path that glob 'out/*.pt' matches"
    ), str(err.value)
    assert str(err.value).endswith('got "out/meta.json"')
    bad = tmp_path / "p.yaml"
    bad.write_text(BASE + section)
    assert main(["policy", "explain", str(bad)]) == 2
    assert "script.checkpoints.sidecar" in capsys.readouterr().err


def test_a_file_pending_for_scans_is_warned_about_once(tmp_path, caplog):
    caplog.set_level("WARNING", logger="rollback_supervisor.script")
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, [5], settle_seconds=3600.0) as files:
        _save(ckpt, 1.0, 5)
        for _ in range(PENDING_SCANS + 3):
            assert files.scan() == []  # never settles
    assert caplog.text.count(f"out/ckpt.pt has been pending for {PENDING_SCANS} scans") == 1


FIRST_SAVE_CASES = [
    # (first save expected, seconds since the segment started, step printed last, the warning's words or None)
    (FirstSave(0, 50, 300.0), 10.0, None, None),
    (FirstSave(0, 50, 300.0), 10.0, 50, None),  # the save of step 50 may still be on its way
    (FirstSave(0, 50, 300.0), 10.0, 51, "printed step 51, past step 50 by which its first save was expected"),
    (FirstSave(1000, 50, 300.0), 10.0, 1040, None),  # a relaunch at step 1000 saves by step 1050
    (FirstSave(1000, 50, 300.0), 10.0, 1051, "(script.checkpoints.expect_within_steps: 50 from step 1000)"),
    (
        FirstSave(0, 50, 300.0),
        300.0,
        3,
        "it is 300 s since the segment started (script.checkpoints.warn_after_seconds: 300)",
    ),
    (FirstSave(0, None, 300.0), 299.0, 10_000, None),  # no step expected: only the time counts
    (FirstSave(0, None, None), 1e9, 10_000, None),  # both off: never
]


@pytest.mark.parametrize(("first", "elapsed", "printed", "words"), FIRST_SAVE_CASES)
def test_the_first_save_is_overdue_past_its_step_or_its_time(first, elapsed, printed, words):
    why = first.overdue(elapsed, printed)
    assert (why is None) if words is None else (words in why), why


def _watched(tmp_path: Path, printed: list[int | None], clock: Clock, first: FirstSave) -> ScriptFiles:
    """Script files whose output has printed `printed[0]` last, on `clock`, with nothing saved yet."""
    return _files(tmp_path, [0], clock=clock, first_save=first, printed_step=lambda: printed[0])


def test_no_warning_after_many_scans_while_the_printed_step_is_before_the_first_save(tmp_path, caplog):
    caplog.set_level("WARNING", logger="rollback_supervisor.script")
    clock, printed = Clock(), [None]
    with _watched(tmp_path, printed, clock, FirstSave(0, 50, 300.0)) as files:
        for step in range(50):  # a scan a second, a step a second: 50 s in, at step 49, nothing saved yet
            printed[0], clock.now = step, clock.now + 1
            assert files.scan() == []
    assert "has matched no file" not in caplog.text


def test_a_step_past_the_first_save_with_no_file_is_warned_about_once(tmp_path, caplog):
    caplog.set_level("WARNING", logger="rollback_supervisor.script")
    clock, printed = Clock(), [49]
    with _watched(tmp_path, printed, clock, FirstSave(0, 50, 300.0)) as files:
        files.scan()
        printed[0] = 51
        for _ in range(3):
            files.scan()
    assert caplog.text.count("has matched no file") == 1
    assert (
        "script.checkpoints.glob 'out/ckpt.pt' has matched no file under "
        f"{tmp_path / 'run'}, and the script printed step 51, past step 50 by which its first save was expected"
    ) in caplog.text


def test_a_glob_matching_nothing_is_warned_about_after_the_configured_time(tmp_path, caplog):
    caplog.set_level("WARNING", logger="rollback_supervisor.script")
    clock, printed = Clock(), [None]  # metrics from MLflow only: no step is ever printed
    with _watched(tmp_path, printed, clock, FirstSave(0, None, 120.0)) as files:
        clock.now += 119
        files.scan()
        assert "has matched no file" not in caplog.text
        clock.now += 1
        files.scan()
        files.scan()
    assert caplog.text.count("has matched no file") == 1
    assert "it is 120 s since the segment started (script.checkpoints.warn_after_seconds: 120)" in caplog.text


def test_a_file_once_matched_silences_the_warning(tmp_path, caplog):
    caplog.set_level("WARNING", logger="rollback_supervisor.script")
    clock, printed = Clock(1e12), [10]
    with _watched(tmp_path, printed, clock, FirstSave(0, 50, 300.0)) as files:
        _save(tmp_path / "run" / "out" / "ckpt.pt", 1.0, 10)
        files.scan()
        (tmp_path / "run" / "out" / "ckpt.pt").unlink()  # gone again, but the glob did match: no warning
        printed[0], clock.now = 500, clock.now + 1000
        files.scan()
    assert "has matched no file" not in caplog.text


def test_a_segment_expects_its_first_save_from_the_policy_and_its_printed_steps(tmp_path, caplog):
    caplog.set_level("WARNING", logger="rollback_supervisor.script")
    section = (
        f"  output: {{patterns: ['{NANOGPT}']}}\n"
        "  checkpoints: {glob: out/ckpt.pt, expect_within_steps: 250, warn_after_seconds: 900}\n"
    )
    mode = ScriptMode(parse_policy(BASE + section, "p.yaml"), "p.yaml", tmp_path / "store", cwd=str(tmp_path))
    lineage = tmp_path / "w" / "lineages" / "L"
    paths = SegmentPaths(lineage / "0.jsonl", lineage / "heartbeat.json", lineage / "faults.json")
    seg = mode.segment(0, RestoreSpec(), ("python", "t.py"), paths, {}, None)
    assert seg.files.first_save == FirstSave(0, 250, 900.0)
    with seg.files as files:
        seg.tap("stdout", "iter 250: loss 2.0")
        files.scan()
        assert "has matched no file" not in caplog.text
        seg.tap("stdout", "iter 251: loss 2.0")
        files.scan()
    seg.tap.close()
    assert "the script printed step 251, past step 250 by which its first save was expected" in caplog.text


def test_the_policy_explains_when_a_glob_matching_nothing_is_warned_about():
    policy = parse_policy(
        BASE + f"  output: {{patterns: ['{NANOGPT}']}}\n"
        "  checkpoints: {glob: out/ckpt.pt, expect_within_steps: 250, warn_after_seconds: 900}\n"
    )
    assert (
        "  A glob that has matched no file yet is warned about once the script prints a step more than 250 steps "
        "past the one a segment started at (expect_within_steps) or 900 s after a segment starts "
        "(warn_after_seconds), whichever comes first."
    ) in summarize(policy).splitlines()
    default = parse_policy(
        BASE + f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: out/ckpt.pt}}\n"
    )
    assert default.script.checkpoints.warn_after_seconds == 300.0
    assert "warned about 300 s after a segment starts (warn_after_seconds)." in summarize(default)
    off = parse_policy(
        BASE
        + f"  output: {{patterns: ['{NANOGPT}']}}\n  checkpoints: {{glob: out/ckpt.pt, warn_after_seconds: null}}\n"
    )
    assert "A glob that matches no file is never warned about" in summarize(off)


def test_a_version_takes_the_metrics_printed_by_its_own_step(tmp_path):
    clock = Clock()
    tap = OutputTap(OutputParser([NANOGPT]), clock=clock)
    for step, loss in ((9, "0.5"), (10, "0.4"), (11, "nan")):
        clock.now += 1
        tap("stdout", f"iter {step}: loss {loss}")
    assert tap.metrics_at(8) == {} and tap.metrics_at(10) == {"loss": 0.4} and tap.latest()["loss"] != 0.4
    ckpt = tmp_path / "run" / "out" / "ckpt.pt"
    with _files(tmp_path, [10]) as files:  # labelled step 10; the scan runs after step 11 printed NaN
        _save(ckpt, 1.0, 10)
        (cid,) = files.scan(final=True, metrics=tap.metrics_at)
        (info,) = files.catalog.list()
    assert info.id == cid and info.healthy and info.metrics == {"loss": 0.4}


# -- review round 2: command/template agreement, symlinked output, damaged blobs, warm detectors ------------


def _runner_options(tmp_path: Path, *args: str, policy: Path = SCRIPT_POLICY):
    from supervisor.orchestrator import RunOptions

    return RunOptions(
        command=(sys.executable, "train.py", *args),
        policy_path=str(policy),
        lineage="values",
        workdir=tmp_path / "w",
        cwd=str(tmp_path),
    )


def test_a_command_value_the_relaunch_would_change_is_refused_naming_both_values(tmp_path):
    """script.yaml renders --learning_rate={lr * lr_scale} with lr 2.0: a command at 0.3 would resume at 2.0."""
    from supervisor.orchestrator import LineageRunner

    with pytest.raises(PolicyError) as err:
        LineageRunner(_runner_options(tmp_path, "--learning_rate=0.1", "--learning_rate=0.3"))
    line = str(err.value)
    at = next(i for i, t in enumerate(SCRIPT_POLICY.read_text().splitlines(), 1) if "args:" in t)
    assert line.startswith(f"{SCRIPT_POLICY}:{at}:11: script.relaunch.args: "), line
    assert "command's --learning_rate=0.3, got --learning_rate=2.0" in line  # the last one given counts
    assert "set script.relaunch.values" in line and err.value.exit_code == 2 and "\n" not in line
    # The same value written otherwise, a command without the key, and keys with no field are all accepted.
    for args in (["--learning_rate=2e0"], [], ["--init_from=scratch", "--learning_rate=2.0"]):
        LineageRunner(_runner_options(tmp_path, *args)).close()


def test_explain_prints_the_relaunch_arguments_rendered_at_lr_scale_1(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    text = SCRIPT_POLICY.read_text()
    args = (
        "args: --init_from=resume --learning_rate={lr * lr_scale} --ckpt={checkpoint} --skip={skip_batches}"
    )
    policy.write_text(text.replace("args: --init_from=resume --learning_rate={lr * lr_scale}", args))
    assert main(["policy", "explain", str(policy)]) == 0
    out = capsys.readouterr().out
    assert (
        "Relaunch arguments at lr_scale 1 with no skip: --init_from=resume --learning_rate=2.0 "
        "--ckpt={checkpoint} --skip=0 (" in out
    ), out


def test_a_symlinked_output_directory_is_versioned_and_put_back_through_its_target(tmp_path, caplog):
    caplog.set_level("INFO", logger="rollback_supervisor.script")
    scratch = tmp_path / "scratch" / "out"
    scratch.mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "out").symlink_to(scratch, target_is_directory=True)
    ckpt, step = tmp_path / "run" / "out" / "ckpt.pt", [10]
    with _files(tmp_path, step, clock=Clock(1e12)) as files:
        first = _save(ckpt, 1.0, 10)
        (v10,) = files.scan(final=True)
        _save(ckpt, 2.0, 20)
        step[0] = 20
        (v20,) = files.scan(final=True)
        assert f"out/ckpt.pt resolves to {scratch / 'ckpt.pt'}, outside" in caplog.text
        restored = files.restore(v10, rollback=True)
    assert restored.id == v10 and (scratch / "ckpt.pt").read_bytes() == first and ckpt.is_file()
    state = json.loads(open_store(tmp_path / "store").read(f"ckpt-{v10}/state.json"))
    assert state["resolved"] == {"out/ckpt.pt": str(scratch / "ckpt.pt")}
    assert "resolved" not in restored.notes
    # The link now leads elsewhere: the version is not written there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run" / "out").unlink()
    (tmp_path / "run" / "out").symlink_to(elsewhere, target_is_directory=True)
    with (
        _files(tmp_path, [0]).open(baseline=False) as files,
        pytest.raises(CheckpointCorrupt, match=f"it resolved to {scratch / 'ckpt.pt'} when versioned"),
    ):
        files.restore(v10)
    assert not list(elsewhere.iterdir())


def test_a_symlink_into_the_supervisors_own_files_is_never_versioned(tmp_path, caplog):
    store = tmp_path / "store"
    (store / "out").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "out").symlink_to(store / "out", target_is_directory=True)
    _save(store / "out" / "ckpt.pt", 1.0, 10)
    with _files(tmp_path, [10], clock=Clock(1e12)) as files:
        assert files.matches() == {} and files.scan(final=True) == []
    assert "one of the supervisor's own files" in caplog.text


def test_a_damaged_blob_falls_back_to_the_next_older_version(tmp_path, caplog):
    from supervisor.script.relaunch import plan_start

    caplog.set_level("INFO", logger="rollback_supervisor.script")
    ckpt, step = tmp_path / "run" / "out" / "ckpt.pt", [10]
    saved = {}
    with _files(tmp_path, step, clock=Clock(1e12)) as files:
        for n in (10, 20, 30):
            step[0] = n
            saved[n] = _save(ckpt, float(n), n)
            (saved[f"id{n}"],) = files.scan(final=True)
    catalog = open_store(tmp_path / "store")
    blob = tmp_path / "store" / catalog.manifest(saved["id30"]).tensors["out/ckpt.pt"].blob
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF  # same size: only a full read finds it
    blob.write_bytes(bytes(raw))
    ckpt.write_bytes(b"a save cut short")  # what the killed script left in place
    template = ArgTemplate.parse("--init_from=resume")
    spec = RestoreSpec(checkpoint_id=saved["id30"])
    start = plan_start(_files(tmp_path, [0]), template, {}, ("train",), spec, first=False)
    assert start.version.id == saved["id20"] and start.step == 20
    assert ckpt.read_bytes() == saved[20] and not list(ckpt.parent.glob(".*tmp"))
    assert f"Not restoring checkpoint {saved['id30']} (checkpoint {saved['id30']} is invalid:" in caplog.text
    assert f"relaunching from checkpoint {saved['id20']} instead of {saved['id30']}" in caplog.text
    # Nothing healthy left: the relaunch fails, naming each version and why.
    for n in (10, 20):
        (tmp_path / "store" / catalog.manifest(saved[f"id{n}"]).tensors["out/ckpt.pt"].blob).write_bytes(b"x")
    ckpt.write_bytes(b"a save cut short")
    with pytest.raises(CheckpointError, match="can be put back for the relaunch"):
        plan_start(_files(tmp_path, [0]), template, {}, ("train",), spec, first=False)


def test_the_surviving_branch_warms_the_next_segments_detectors(tmp_path):
    """Points after the version a segment resumes from are dropped; a baseline set before still counts."""
    from supervisor.monitor import Point
    from supervisor.script.mode import _extend_branch

    branch: list = []
    _extend_branch(branch, [Point("loss", s, 1.0, 0.0) for s in range(10)])
    _extend_branch(branch, [Point("loss", s, 2.0, 1.0) for s in (4, 5, 6)])  # the script went back to step 4
    assert [(p.step, p.value) for p in branch] == [(s, 1.0) for s in range(4)] + [
        (4, 2.0),
        (5, 2.0),
        (6, 2.0),
    ]
    spec = [{"type": "divergence", "metric": "loss", "window": 2, "factor": 1.5, "patience": 1}]
    tap = OutputTap(OutputParser([NANOGPT]))
    warm = ScriptWatcher(tap, DetectorSet(build_detectors(spec)), history=branch[:4])
    cold = ScriptWatcher(OutputTap(OutputParser([NANOGPT])), DetectorSet(build_detectors(spec)))
    for watcher in (warm, cold):
        for s, loss in ((4, 1.6), (5, 1.6), (6, 1.6)):
            watcher.tap("stdout", f"iter {s}: loss {loss}")
    assert [e.type for e in warm.poll(1.0)] == ["divergence"] and cold.poll(1.0) == []
    assert [p.step for p in warm.observed] == [4, 5, 6]


WARM_POLICY = f"""\
version: 1
name: warm
monitor:
  detectors:
    - {{type: divergence, metric: loss, window: 2, factor: 1.5, patience: 1}}
    - {{type: non_finite, metrics: [loss, grad_norm]}}
rules:
  - when: [unknown_exit]
    action: resume
script:
  output: {{patterns: ['{NANOGPT}']}}
  checkpoints: {{glob: 'out/ckpt.pt', settle_seconds: 0}}
"""


def test_a_fresh_supervisor_warms_its_detectors_on_the_branch_mlflow_logged(tmp_path, caplog):
    """A supervisor that takes over a lineage (the previous one died) has read no output yet: its first
    segment's detectors warm up on the lineage run's surviving branch, up to the version it resumes from."""
    from supervisor.report import ReportError
    from supervisor.script.files import Restored
    from supervisor.script.relaunch import Start

    asked = []

    def logged(names):
        asked.append(names)
        first = [(s, 1.0, 1000 + s) for s in range(1, 31)]  # steps 1..30
        again = [(s, 2.0, 5000 + s) for s in range(21, 26)]  # rolled back to 20, then ran 21..25
        return {"loss": first + again, "grad_norm": []}

    mode = ScriptMode(parse_policy(WARM_POLICY, "p.yaml"), "p.yaml", tmp_path / "store", cwd=str(tmp_path))
    mode.warm_from = logged
    start = Start(("python", "train.py"), Restored("0000000024-000003", 24, ("out/ckpt.pt",), {}), 1.0)
    history = mode._branch_to(start)
    assert asked == [("loss", "grad_norm")]
    assert [(p.step, p.value) for p in history] == [(s, 1.0) for s in range(1, 21)] + [
        (s, 2.0) for s in range(21, 25)
    ]
    mode.warm_from = lambda names: pytest.fail("the branch is known: MLflow is not asked again")
    assert [p.step for p in mode._branch_to(start)] == [p.step for p in history]

    def unreachable(names):
        raise ReportError("MLflow run r at http://127.0.0.1:9: cannot read metric history: refused")

    cold = ScriptMode(parse_policy(WARM_POLICY, "p.yaml"), "p.yaml", tmp_path / "store2", cwd=str(tmp_path))
    cold.warm_from = unreachable
    assert cold._branch_to(start) == []
    assert "the detectors start cold" in caplog.text
    # From scratch there is nothing to warm on.
    fresh = ScriptMode(parse_policy(WARM_POLICY, "p.yaml"), "p.yaml", tmp_path / "store3", cwd=str(tmp_path))
    fresh.warm_from = lambda names: pytest.fail("a segment from scratch asks for no history")
    assert fresh._branch_to(Start(("python", "train.py"), None, 1.0)) == []
