"""The policy file, version 1: what to checkpoint, what to watch, and what to do about each event."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies.base import Spec, problem
from policies.launcher_schema import LauncherConfig
from policies.monitor_schema import MonitorConfig
from policies.targets import Target
from supervisor.checkpoint.options import MEMORY_SLOTS, MEMORY_SLOTS_DOC
from supervisor.events import EventType
from supervisor.script.output import glob_regex, pattern_problem
from supervisor.script.template import BUILTIN_FIELDS, ArgTemplate, TemplateError

Mode = Literal["min", "max"]
Action = Literal["resume", "rollback", "stop", "fail", "warn"]
ACTIONS: tuple[str, ...] = Action.__args__  # type: ignore[attr-defined]
RELAUNCH_ACTIONS = frozenset({"resume", "rollback"})
#: Events `warn` may answer: found while training goes on, with a state worth training on. Not `non_finite`
#: (NaN or infinite weights: training on saves nothing), nor the process events (the process is gone, or hung).
WARN_EVENTS: tuple[str, ...] = ("spike", "divergence", "threshold", "plateau", "straggler")


class KeepBest(Spec):
    """Keep the `count` best checkpoints by one metric."""

    metric: str = Field(min_length=1, description="Metric recorded with each checkpoint, e.g. val_loss.")
    mode: Mode = Field("min", description="`min` if lower is better, `max` if higher is better.")
    count: int = Field(1, ge=1, description="How many of the best checkpoints to keep.")


class CheckpointConfig(Spec):
    """When checkpoints are written, where, how many are kept and how they are verified."""

    every_steps: int | None = Field(
        200, ge=1, description="Save every this many steps; with `adaptive`, the longest allowed interval."
    )
    every_seconds: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Also save when this many seconds passed since the last save.",
    )
    adaptive: bool = Field(
        False,
        description="Pick the interval from the measured save cost and the lineage's failure rate "
        "(Young/Daly: sqrt(2 x save cost x MTBF), MTBF = the lineage's age / its failures, age at least 60 s), "
        "capped by `every_steps`.",
    )
    keep_last: int = Field(3, ge=1, description="Keep this many newest checkpoints.")
    keep_best: KeepBest | None = Field(
        None, description="Also keep the best checkpoints by a metric; null for none."
    )
    keep_every_steps: int | None = Field(
        None,
        ge=1,
        description="Also keep forever every checkpoint whose step is a multiple of this; null for none.",
    )
    async_: bool = Field(
        True, alias="async", description="Write checkpoints in the background while training continues."
    )
    memory_slots: int = Field(MEMORY_SLOTS, ge=1, description=MEMORY_SLOTS_DOC)
    sharded: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Multi-process jobs: `auto` saves sharded (every rank its share, through DCP) a model with "
        "DTensor parameters (FSDP2) and a DDP model of at least 50M parameters, where that path measured faster "
        "(`bench checkpoint --ddp-paths`); `always` any model of a multi-process job; `never` keeps DDP on "
        "rank 0's writer (an FSDP2 model is always sharded).",
    )
    overlap: bool = Field(
        False,
        description="With async: copy parameters and optimizer state into host memory beside the next forward "
        "and backward, the optimizer's next step waiting for the copy, instead of before training goes on. "
        "Only for models whose parameters change in the optimizer's step alone (module buffers are copied at "
        "once).",
    )
    storage: str = Field(
        "./checkpoints", min_length=1, description="Local directory or fsspec URL of the store."
    )
    remote: str | None = Field(
        None,
        pattern=r"^[A-Za-z][A-Za-z0-9+.-]*://.+",
        examples=["s3://bucket/run"],
        description="fsspec URL (e.g. s3://bucket/run) of a remote tier each checkpoint is copied to; null for none.",
    )
    verify: Literal["full", "fast", "none"] = Field(
        "full",
        description="Check before restoring: `full` hashes every byte, `fast` checks sizes and manifest, `none` skips.",
    )
    allow_nonfinite: bool = Field(
        False,
        description="Allow an unhealthy checkpoint (a NaN or an infinity in its parameters or optimizer state "
        "when it was taken) as a rollback or resume target and as the latest to resume from.",
    )

    @model_validator(mode="after")
    def _has_a_trigger(self) -> CheckpointConfig:
        if self.every_steps is None and self.every_seconds is None:
            raise problem(
                "every_steps", "an integer >= 1 when every_seconds is null (nothing would save)", None
            )
        if self.adaptive and self.every_steps is None:
            raise problem("every_steps", "an integer >= 1 as the cap for adaptive: true", None)
        fixed = self.every_steps is not None and not self.adaptive and self.every_seconds is None
        if fixed and self.keep_every_steps is not None and self.keep_every_steps % self.every_steps:
            raise problem(
                "keep_every_steps",
                f"a multiple of every_steps ({self.every_steps}) or no checkpoint is ever kept",
                self.keep_every_steps,
            )
        return self


class Rule(Spec):
    """What to do when one of the `when` events arrives; rules are tried in order and the first match wins."""

    when: list[EventType] = Field(min_length=1, description="Event types this rule handles.")
    action: Action = Field(
        description="`resume` relaunches from the target, `rollback` relaunches from an earlier checkpoint "
        "(never one saved at or after the anomaly's onset), `stop` ends the run successfully keeping the best "
        "checkpoint, `fail` ends it as failed, `warn` records and reports the event and training goes on "
        "(no restore, no stop, no relaunch, no budget spent; for " + ", ".join(WARN_EVENTS) + " only)."
    )
    target: Target | None = Field(
        None,
        description="Checkpoint to relaunch from: {select: latest | best | before | best_before | "
        '"module:function", ...}. Required for rollback; resume defaults to latest; not allowed for stop or fail.',
    )
    skip_batches: int = Field(
        0,
        ge=0,
        description="Data batches to skip after relaunching, to step over the data that caused the event.",
    )
    lr_scale: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Factor applied on top of the learning rate restored from the target checkpoint "
        "(0.5 halves it, 1 leaves it unchanged).",
    )
    allow_scratch: bool = Field(
        False,
        description="Restart from step 0, instead of failing, when there is no checkpoint to relaunch from: none "
        "the rule may use at all, or none matching a `target` with `strict: true` (a target that is not strict "
        "falls back to the newest usable checkpoint first).",
    )

    @model_validator(mode="after")
    def _fits_action(self) -> Rule:
        seen: set[str] = set()
        for i, event in enumerate(self.when):
            if event in seen:
                raise problem(f"when.{i}", "each event type once", event)
            seen.add(event)
        if self.action == "rollback" and self.target is None:
            raise problem(
                "",
                "a target for action rollback, e.g. {select: before, lookback_steps: 100}",
                raw="no target",
            )
        if self.action == "warn":
            for i, event in enumerate(self.when):
                if event not in WARN_EVENTS:
                    raise problem(f"when.{i}", _warn_refusal(event), event)
        if self.action not in RELAUNCH_ACTIONS:
            for key in ("target", "skip_batches", "lr_scale", "allow_scratch"):
                if key in self.model_fields_set:
                    value = getattr(self, key)
                    found = value.model_dump(by_alias=True) if isinstance(value, Spec) else value
                    raise problem(key, f"no {key} with action {self.action} (nothing is relaunched)", found)
        return self


def _warn_refusal(event: str) -> str:
    """What a warn rule may name instead of `event`, and why not it."""
    why = (
        "NaN or infinite values leave nothing worth training on: roll back"
        if event == "non_finite"
        else "the process is hung: resume or fail"
        if event == "hang"
        else "the process is gone, so there is nothing to train on: resume or fail"
    )
    return f"an event type warn can leave training on ({', '.join(WARN_EVENTS)}; for {event}, {why})"


class Backoff(Spec):
    """Delay before each relaunch: exponential, capped, optionally jittered."""

    initial_seconds: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="Delay before the first relaunch."
    )
    max_seconds: float = Field(300.0, ge=0, allow_inf_nan=False, description="Longest delay.")
    multiplier: float = Field(
        2.0, ge=1, allow_inf_nan=False, description="Each further relaunch waits this many times longer."
    )
    jitter: bool = Field(
        True, description="Randomise each delay between half and all of it (seeded, reproducible)."
    )
    reset_after_seconds: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="Relaunches older than this no longer lengthen the delay.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Backoff:
        if self.max_seconds < self.initial_seconds:
            raise problem(
                "max_seconds", f"a number >= initial_seconds ({self.initial_seconds:g})", self.max_seconds
            )
        return self


class Escalation(Spec):
    """Rollback-loop handling: the same anomaly recurring near the same step after a rollback."""

    same_step_window: int = Field(
        50,
        ge=0,
        description="An anomaly of the same type whose onset is within this many steps of an earlier "
        "rollback's onset counts as a recurrence.",
    )
    lookback_multiplier: float = Field(
        2.0,
        ge=1,
        allow_inf_nan=False,
        description="On the k-th recurrence the target's lookback_steps is multiplied by this to the power k.",
    )
    max_escalations: int = Field(
        1, ge=0, description="Recurrences handled by a longer lookback; one more fails the run."
    )


class Limits(Spec):
    """Budgets, backoff and rollback-loop escalation for the whole run."""

    max_rollbacks: int = Field(5, ge=0, description="Most rollbacks per run; the next one fails the run.")
    max_restarts: int = Field(
        20,
        ge=0,
        description="Most relaunches of any kind (resume and rollback) per run; the next one fails it.",
    )
    backoff: Backoff = Field(default_factory=Backoff, description="Delay before each relaunch.")
    escalation: Escalation | None = Field(
        default_factory=Escalation, description="Rollback-loop escalation; null turns loop detection off."
    )

    @model_validator(mode="after")
    def _rollbacks_fit_restarts(self) -> Limits:
        if self.max_rollbacks > self.max_restarts:
            raise problem(
                "max_rollbacks",
                f"at most max_restarts ({self.max_restarts}), since every rollback is a restart",
                self.max_rollbacks,
            )
        return self


class ScriptOutput(Spec):
    """How metrics are read from an unmodified script's stdout and stderr lines."""

    patterns: list[str] = Field(
        default_factory=list,
        examples=[r"iter (?P<step>\d+): loss (?P<loss>[^,\s]+)"],
        description="Regular expressions searched in every output line, first match wins. Each needs a named "
        "group `step` (an integer); every other named group is a metric of that step, e.g. "
        "`iter (?P<step>\\d+): loss (?P<loss>[^,\\s]+)`. Empty: metrics come only from the script's own "
        "MLflow logging, which joins the lineage's run (see `script.mlflow`).",
    )

    @field_validator("patterns")
    @classmethod
    def _readable(cls, patterns: list[str]) -> list[str]:
        for i, pattern in enumerate(patterns):
            if (why := pattern_problem(pattern)) is not None:
                raise problem(str(i), f"a regular expression with a named group `step` (this one {why})")
        return patterns


#: Globs ending so default to `format: zip` (what torch.save writes, and Lightning's .ckpt).
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt")


class ScriptCheckpoints(Spec):
    """The script's own checkpoint files, versioned into the store as opaque blobs whenever they appear or change."""

    glob: str = Field(
        min_length=1,
        examples=["out/ckpt.pt"],
        description="Files to version, relative to the command's working directory, e.g. `out/ckpt.pt` or "
        "`checkpoints/step_*.pt` (`**` matches any depth).",
    )
    step_from: Literal["output", "name", "sidecar"] = Field(
        "output",
        description="Where a version's step comes from: `output`, the step of the last output line read "
        "before the file's modification time (for one overwritten file such as nanoGPT's ckpt.pt); `name`, "
        "the `step` group of `step_pattern` in the file's path (each step its own version); `sidecar`, a "
        "number in the `sidecar` file.",
    )
    step_pattern: str | None = Field(
        None,
        examples=[r"step_(?P<step>\d+)\.pt$"],
        description="With `step_from: name`: a regular expression with a named group `step`, searched in the "
        "file's path relative to the working directory; matched files it does not match are not versioned.",
    )
    sidecar: str | None = Field(
        None,
        examples=["out/meta.json"],
        description="With `step_from: sidecar`: a JSON or text file, relative to the working directory, that "
        "the script writes with each checkpoint. `glob` must match it too, so that it is versioned and restored "
        "with them.",
    )
    sidecar_key: str | None = Field(
        None,
        examples=["iter_num"],
        description="The key of the step in the sidecar's JSON object; null: the sidecar's whole text is the step.",
    )
    format: Literal["opaque", "zip"] | None = Field(
        None,
        description="`zip`: a file is versioned only once it reads as a whole zip archive with correct CRCs "
        "(torch.save's format; nothing is unpickled), so a save cut short by a kill is never a version; the "
        "sidecar is exempt. `opaque`: any bytes, versioned once unchanged for `settle_seconds`. Null: `zip` when "
        "the glob ends in .pt, .pth or .ckpt, else `opaque`. Set `opaque` for a .pt file that is not a zip "
        "archive (torch.save with _use_new_zipfile_serialization=False).",
    )
    scan_seconds: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="How often the files are checked while the script runs."
    )
    settle_seconds: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="A changed file is versioned once it has been unchanged this long (and at the script's exit).",
    )
    expect_within_steps: int | None = Field(
        None,
        ge=1,
        examples=[250],
        description="The script's first save comes within this many steps of the step a segment starts at "
        "(nanoGPT: its `eval_interval`). Once the output has printed a step past that and `glob` has still "
        "matched no file, a warning says so. Needs `output.patterns` (the steps are read from the output). Null: "
        "no step is expected, only `warn_after_seconds` applies.",
    )
    warn_after_seconds: float | None = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="Warn when `glob` has matched no file this many seconds after a segment started; set it "
        "above the script's time to its first save. Null: never by time.",
    )

    @field_validator("glob")
    @classmethod
    def _inside(cls, glob: str) -> str:
        parts = glob.replace("\\", "/").split("/")
        if glob.startswith(("/", "~")) or ".." in parts:
            raise problem("", "a glob relative to the working directory, without `..`", glob)
        return glob

    @field_validator("step_pattern")
    @classmethod
    def _step_pattern(cls, pattern: str | None) -> str | None:
        if pattern is not None and (why := pattern_problem(pattern)) is not None:
            raise problem("", f"a regular expression with a named group `step` (this one {why})")
        return pattern

    @model_validator(mode="after")
    def _step_source(self) -> ScriptCheckpoints:
        if self.step_from == "name" and self.step_pattern is None:
            raise problem(
                "step_pattern", "a regular expression with a named group `step` for step_from: name"
            )
        if self.step_from == "sidecar" and self.sidecar is None:
            raise problem("sidecar", "the path of the sidecar file for step_from: sidecar")
        if self.step_from == "sidecar" and self.sidecar is not None:
            rel = self.sidecar.replace("\\", "/").removeprefix("./")
            if not glob_regex(self.glob).match(rel):
                raise problem(
                    "sidecar",
                    f"a path that glob {self.glob!r} matches, so that the sidecar is versioned and put back with "
                    "the checkpoint it names the step of (widen the glob, e.g. `out/*`)",
                    self.sidecar,
                )
        return self

    def file_format(self) -> Literal["opaque", "zip"]:
        """`format`, or its default: `zip` for a glob ending in torch.save's suffixes, else `opaque`."""
        if self.format is not None:
            return self.format
        return "zip" if self.glob.endswith(TORCH_SUFFIXES) else "opaque"


class ScriptRelaunch(Spec):
    """How the script is resumed: arguments appended to its command on every relaunch, filled from the decision."""

    args: list[str] | str = Field(
        default_factory=list,
        examples=["--init_from=resume --learning_rate={lr * lr_scale}"],
        description="Arguments appended to the command on each relaunch (the first launch runs the command as "
        "given), a list or one string split as a shell does. Fields: `{checkpoint}` (the restored file's path), "
        "`{step}` (its step), `{lr_scale}` (the chosen checkpoint's LR factor times the decision's), "
        "`{skip_batches}`, and the names under `values`; a field may be a product such as `{lr * lr_scale}` "
        "and take a format spec, `{lr * lr_scale:.3e}`. A rule key with no field here is unsupported.",
    )
    values: dict[str, float] = Field(
        default_factory=dict,
        examples=[{"lr": 0.0006}],
        description="Named numbers the arguments may use, e.g. `{lr: 6.0e-4}` for `{lr * lr_scale}` "
        "(YAML reads `6e-4` without a dot as a string).",
    )

    @field_validator("values", mode="before")
    @classmethod
    def _numbers(cls, values: object) -> object:
        if not isinstance(values, dict):
            return values
        for name, value in values.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise problem("", "names that are identifiers, like lr", name)
            if name in BUILTIN_FIELDS:
                raise problem(
                    str(name), f"a name other than the built-in fields ({', '.join(BUILTIN_FIELDS)})", name
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise problem(str(name), "a number (YAML needs a dot in 6.0e-4; 6e-4 is a string)", value)
        return values

    @model_validator(mode="after")
    def _fields_known(self) -> ScriptRelaunch:
        try:
            ArgTemplate.parse(self.args, self.values)
        except TemplateError as exc:
            at = "args" if exc.item is None else f"args.{exc.item}"
            raise problem(at, exc.expected, raw=exc.found) from None
        return self

    def template(self) -> ArgTemplate:
        """The parsed argument template."""
        return ArgTemplate.parse(self.args, self.values)


class ScriptConfig(Spec):
    """Script mode: supervise a command that does not use the training-side API (e.g. nanoGPT's train.py)."""

    output: ScriptOutput = Field(
        default_factory=ScriptOutput, description="How metrics are read from the script's output lines."
    )
    checkpoints: ScriptCheckpoints = Field(description="The script's own checkpoint files and their steps.")
    relaunch: ScriptRelaunch = Field(
        default_factory=ScriptRelaunch, description="The arguments that make the script resume."
    )
    mlflow: Literal["join", "off"] | None = Field(
        None,
        description="`join`: MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID and MLFLOW_RUN_ID are exported, so the "
        "script's own `mlflow.start_run()` logs into the lineage's run. Two traps: a script that calls "
        "`mlflow.set_experiment(...)` before `start_run()` fails (the active experiment does not match the run "
        "the environment names), and one that logs a parameter whose value changes on a relaunch (a scaled "
        "learning rate) raises, MLflow params being immutable. `off`: nothing is exported; the script's MLflow "
        "calls go where they would without us (YAML's unquoted `off` reads as false, taken as `off`). Null: "
        "`off` when output.patterns are given, else `join`.",
    )

    @field_validator("mlflow", mode="before")
    @classmethod
    def _unquoted_off(cls, value: object) -> object:
        # YAML 1.1 reads an unquoted `off` as false: take it as the word the user wrote.
        return "off" if value is False else value

    def mlflow_mode(self) -> Literal["join", "off"]:
        """`mlflow`, or its default: `off` when metrics are read from the output, else `join`."""
        if self.mlflow is not None:
            return self.mlflow
        return "off" if self.output.patterns else "join"

    @model_validator(mode="after")
    def _steps_readable(self) -> ScriptConfig:
        if self.checkpoints.step_from == "output" and not self.output.patterns:
            raise problem(
                "checkpoints.step_from",
                "name or sidecar when output.patterns is empty (no step is read from the output)",
                "output",
            )
        if self.checkpoints.expect_within_steps is not None and not self.output.patterns:
            raise problem(
                "checkpoints.expect_within_steps",
                "null when output.patterns is empty (no step is read from the output to compare with it)",
                self.checkpoints.expect_within_steps,
            )
        return self


class RelaunchConfig(Spec):
    """How a relaunched segment's process starts."""

    standby: bool = Field(
        False,
        description="Keep the next training process started and parked while a segment runs (interpreter up, "
        "torch and the script's top-level imports done), and start the next segment in it: a relaunch skips "
        "the interpreter start and the imports. Costs one idle process per lineage: about 240 MiB resident "
        "with torch imported, 160 MiB of it its own (the rest is shared library pages), and no CPU while "
        "parked. The local launcher, or `launcher.type: torchrun` on one node with its rendezvous on a free "
        "port (a whole agent is parked with its ranks); `python script.py` or `python -m mod` commands only.",
    )
    imports: list[str] = Field(
        default_factory=list,
        description="Further modules the parked process imports, beyond the script's top-level imports and "
        "torch (e.g. modules the script imports inside functions).",
    )
    standby_delay_seconds: float = Field(
        5.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds after a segment starts before its standby is started, so that the standby's "
        "imports do not compete with the segment's start-up for the CPU.",
    )
    park: Literal["imports", "plan"] = Field(
        "imports",
        description="Where the standby waits. `imports`: after the script's top-level imports. `plan`: it runs "
        "the script from its first line, with the segment's arguments and the base environment, up to the "
        "moment the script first asks for its launch plan (`Session.attach`, or the Lightning / Hugging Face "
        "callback at fit / train start), so the model, data and optimizer are built before the relaunch "
        "decision; the segment's plan and `ROLLBACK_SUPERVISOR_*` variables are set there. Before that point "
        "the script must not read those variables, write files a cold start would not expect written twice, or "
        "train: a standby that read one is not used. Costs the built model's memory while parked. Needs "
        "`standby: true`, and a command that uses the training-side API (not `script:`).",
    )
    park_timeout_seconds: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="`park: plan`: a standby that has not reached its park point this many seconds after it "
        "started, or that exits before it, is killed, never used; later standbys then park at `imports`.",
    )

    preload: bool = Field(
        False,
        description="`park: plan`: while it waits, the standby reads the lineage's newest checkpoint from the "
        "local store into memory, verified in full, and reads again whenever a newer one commits. A relaunch "
        "that restores that checkpoint (a resume from the latest) then copies it from memory into the built "
        "model and hands the rest to the optimizer, with no disk read; any other target is read from disk as "
        "usual. Costs one more state's worth of memory in the standby (model, optimizer and the rest, as "
        "stored; under torchrun, in each parked rank), and one read of each new checkpoint, on one thread, "
        "while a segment runs; a read that would leave less than 1 GiB of memory available is not made. Not "
        "for sharded (DCP) checkpoints.",
    )

    @model_validator(mode="after")
    def _park_needs_standby(self) -> RelaunchConfig:
        if self.park == "plan" and not self.standby:
            raise problem("standby", "true with park: plan (park says where the standby waits)", self.standby)
        if self.preload and self.park != "plan":
            raise problem(
                "park", "plan with preload: true (the standby preloads at its park point)", self.park
            )
        return self


class Policy(Spec):
    """A rollback policy: checkpointing, monitoring, the rules mapping events to actions, and the limits."""

    version: Literal[1] = Field(description="Schema version of this file; must be 1.")
    name: str = Field(min_length=1, description="Name shown in logs, MLflow tags and Prefect artifacts.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="When and where checkpoints are written and kept."
    )
    monitor: MonitorConfig = Field(
        default_factory=MonitorConfig, description="What is watched and how often."
    )
    rules: list[Rule] = Field(
        min_length=1,
        description="Event handling rules, first match wins; events no rule names make the run fail.",
    )
    limits: Limits = Field(
        default_factory=Limits, description="Budgets, backoff and rollback-loop escalation."
    )
    script: ScriptConfig | None = Field(
        None,
        description="Script mode, for a command that does not use the training-side API: how its metrics, "
        "checkpoint files and relaunch arguments are found; null for a command that uses Session.",
    )
    relaunch: RelaunchConfig = Field(
        default_factory=RelaunchConfig, description="How relaunched segments start (the warm standby)."
    )
    launcher: LauncherConfig = Field(
        default_factory=LauncherConfig,
        description="What runs each segment: a local process group or a SLURM job.",
    )

    @field_validator("version", mode="before")
    @classmethod
    def _integer_version(cls, value: object) -> object:
        # Literal[1] also matches True and 1.0 (they compare equal to 1); only the integer is version 1.
        if type(value) is not int:
            raise problem("", "1", value)
        return value

    @model_validator(mode="after")
    def _no_shadowed_events(self) -> Policy:
        owner: dict[str, int] = {}
        for r, rule in enumerate(self.rules):
            for i, event in enumerate(rule.when):
                if event in owner:
                    raise problem(
                        f"rules.{r}.when.{i}",
                        f"an event type not already handled by rules[{owner[event]}]",
                        event,
                    )
                owner[event] = r
        return self

    @model_validator(mode="after")
    def _park_at_plan_needs_the_api(self) -> Policy:
        if self.script is not None and self.relaunch.park == "plan":
            raise problem(
                "relaunch.park",
                "imports with a `script:` section (a script that never asks for a launch plan would train "
                "unsupervised in the standby)",
                "plan",
            )
        return self

    def rule_for(self, event_type: str) -> tuple[int, Rule] | None:
        """The first rule handling `event_type`, with its index."""
        for index, rule in enumerate(self.rules):
            if event_type in rule.when:
                return index, rule
        return None
