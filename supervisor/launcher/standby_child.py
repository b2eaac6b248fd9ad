"""The parked standby process: import the training command's modules, wait for the plan, run the command as `__main__`.

`supervisor.launcher.standby` starts this file as `python [flags] -c BOOTSTRAP <this file> <config JSON>`, in
the command's working directory and environment, so that nothing is imported that a cold start would not
import: standard library only, and no package of ours (`-m supervisor...` would import `supervisor.launcher`).
The config names the target (`["path", script]` or `["module", name]`), the extra modules to import and the
two pipe descriptors. Once the imports are done it writes one JSON line on the ready pipe (the code files it
loaded, with their mtimes and sizes, so the supervisor can tell a stale standby), then blocks on the plan pipe
for one JSON line: `{"argv", "cwd", "env"}`. The environment then becomes exactly the plan's, and the command
runs as a cold start would run it. End of file on the plan pipe (the supervisor went away) exits quietly.

With `"park": "plan"` (policy `relaunch.park: plan`) it goes further: started in the base environment (no
per-segment `ROLLBACK_SUPERVISOR_*` variable), it runs the command as `__main__` from its first line with the
segment's arguments, and parks where the training side first asks for its launch plan
(`supervisor.runtime.plan.load_plan` calls the `PARK_MODULE` this file puts in `sys.modules`): model build, data
set-up and optimizer creation are then done. There it writes the ready line (the code files loaded by then, and
any per-segment variable the script looked up before its park point, which makes the standby unusable), waits
for the plan, sets the segment's per-segment variables (the rest of the environment is the supervisor's to
check equal, and the script's own changes stay, as in a cold start) and returns into the script.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types

#: Variables that may differ between a parked process and its segment (the plan, the drill's faults): read by
#: the training side only from `load_plan` on. `supervisor.launcher.standby` imports this name.
PER_SEGMENT_PREFIX = "ROLLBACK_SUPERVISOR_"
#: The module a `park: plan` standby puts in `sys.modules`; `supervisor/runtime/plan.py` names it too.
PARK_MODULE = "_rollback_supervisor_park"
#: The training side's plan variable (`supervisor.runtime.plan.PLAN_ENV`: this file imports nothing of ours).
PLAN_VARIABLE = "ROLLBACK_SUPERVISOR_PLAN"
#: Set in a `park: plan` standby's environment only: a file that never exists, in the plan directory of the
#: lineage that parked it (`supervisor.launcher.standby.parked_env`). Not a per-segment variable: the script
#: may see it before its park point, where it is removed. The environment a process was started with is what a
#: later supervisor can read of it, so a segment started in the standby, and its ranks, can be recognised.
PARKED_PLAN_VARIABLE = "ROLLBACK_STANDBY_PLAN"

#: What the supervisor starts: `python -c BOOTSTRAP <this file> <config>` (sys.path[0] stays '' until fixed).
BOOTSTRAP = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__rbs_standby__')"


def top_level_imports(source: str, package: str | None = None) -> list[str]:
    """The modules a module's body imports unconditionally (top level and top-level `try:` bodies), in order.

    `from x import y` yields `x` and `x.y` (the latter is imported only if `y` is not an attribute of `x`, as
    the import statement does). Imports under `if`, in functions or in `except` branches are left out: a cold
    start may never run them.
    """
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.module == "__future__":
                    continue
                if node.level:
                    if not package:
                        continue
                    base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                else:
                    base = node.module or ""
                found.append(base)
                found.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(source).body)
    return list(dict.fromkeys(name for name in found if name))


def _import(name: str, failed: list[str]) -> None:
    parent, _, attr = name.rpartition(".")
    if parent and parent in sys.modules and hasattr(sys.modules[parent], attr):
        return  # `from parent import attr` names an attribute: nothing more to import
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:  # a submodule guess that is not one is fine; a missing dependency is not
            failed.append(f"{name}: {exc}")
    except Exception as exc:  # the cold start would fail the same way; the real run shows the traceback
        failed.append(f"{name}: {type(exc).__name__}: {exc}")


def _target_source(kind: str, name: str) -> tuple[str | None, str | None, str | None]:
    """(source, file, package) of the command's script or module; Nones where it cannot be found."""
    if kind == "path":
        path = os.path.abspath(name)
        try:
            with open(path, "rb") as f:
                return f.read().decode("utf-8", errors="replace"), path, None
        except OSError:
            return None, None, None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None, None, None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None, None, None
    if spec.submodule_search_locations is not None:  # `-m pkg` runs pkg.__main__
        return _target_source(kind, f"{name}.__main__")
    with open(spec.origin, "rb") as f:
        return f.read().decode("utf-8", errors="replace"), spec.origin, name.rpartition(".")[0] or None


def code_files(extra: list[str]) -> list[list]:
    """[path, mtime_ns, size] of every loaded module's file outside the standard library, and of `extra`."""
    stdlib = os.path.dirname(os.__file__) + os.sep
    paths = set(extra)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and not path.startswith(stdlib):
            paths.add(path)
    out = []
    for path in sorted(paths):
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append([path, st.st_mtime_ns, st.st_size])
    return out


def park(config: dict) -> tuple[dict, list[str]]:
    """Import what the command will import; the report for the supervisor, and the imports that failed."""
    kind, name = config["target"]
    # sys.path[0] as the cold start has it: the script's directory, or the working directory for `-m`.
    sys.path[0] = os.path.dirname(os.path.realpath(name)) if kind == "path" else os.getcwd()
    t0 = time.monotonic()
    source, file, package = _target_source(kind, name)
    names = top_level_imports(source, package) if source is not None else []
    failed: list[str] = []
    for module in [*names, *config.get("imports", []), *(["torch"] if config.get("torch", True) else [])]:
        if module not in sys.modules:
            _import(module, failed)
    report = {
        "pid": os.getpid(),
        "imports_s": time.monotonic() - t0,
        "imported": len(names),
        "failed": failed,
        "files": code_files([file] if file else []),
    }
    return report, failed


def run_target(kind: str, argv: list[str]) -> None:
    """Run the command's script or module as `__main__`, as `python script.py` or `python -m mod` would.

    A fresh `__main__` module with the attributes the interpreter gives it (runpy's own helpers run the code
    in a temporary module whose `__builtins__` is a dict, not the module).
    """
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    if kind == "module":
        spec = importlib.util.find_spec(argv[0])
        if spec is not None and spec.submodule_search_locations is not None:  # `-m pkg` runs pkg.__main__
            spec = importlib.util.find_spec(f"{argv[0]}.__main__")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            sys.stderr.write(f"{sys.executable}: No module named {argv[0]}\n")
            sys.exit(1)
        code = spec.loader.get_code(spec.name)
        main.__file__ = spec.origin
        main.__loader__ = spec.loader
        main.__spec__ = spec
        main.__package__ = spec.parent
        main.__cached__ = spec.cached  # type: ignore[attr-defined]
        sys.argv = [spec.origin or argv[0], *argv[1:]]
    else:
        path = os.path.abspath(argv[0])
        main.__file__ = path
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        main.__spec__ = None
        main.__package__ = None
        main.__cached__ = None  # type: ignore[attr-defined]
        sys.argv = list(argv)
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


class _WatchedEnviron(os._Environ):  # type: ignore[name-defined]
    """`os.environ` until the park point: notes every look-up of a per-segment variable (not yet set)."""

    early_reads: list[str] = []

    def _note(self, key: object) -> None:
        if isinstance(key, str) and key.startswith(PER_SEGMENT_PREFIX) and key not in self.early_reads:
            self.early_reads.append(key)

    def __getitem__(self, key: str) -> str:
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return super().__contains__(key)


def _ranked(config: dict) -> bool:
    """Whether this is one rank of a parked torchrun agent: it talks through files, not pipes."""
    return "channel_dir" in config


def _channel_file(config: dict, name: str) -> str:
    return os.path.join(config["channel_dir"], f"{name}-{os.environ.get('LOCAL_RANK', '0')}.json")


def _write_ready(config: dict, report: dict) -> None:
    if not _ranked(config):
        with os.fdopen(config["ready_fd"], "w") as ready:
            ready.write(json.dumps(report) + "\n")
        return
    path = _channel_file(config, "ready")
    report = {**report, "rank": os.environ.get("RANK"), "local_rank": os.environ.get("LOCAL_RANK")}
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: How often a parked rank looks for its plan file: the latency it adds to a relaunch, for a fraction of a
#: percent of a core while parked.
PLAN_POLL_S = 0.01


def _read_plan(config: dict) -> dict | None:
    """The plan, or None: the standby was discarded, or the supervisor that started it is gone."""
    if not _ranked(config):
        with os.fdopen(config["plan_fd"], "rb") as plan_pipe:
            line = plan_pipe.readline()
        return json.loads(line) if line else None
    path, gone = _channel_file(config, "plan"), os.path.join(config["channel_dir"], "discard")
    supervisor, agent, checked = config["supervisor_pid"], os.getppid(), time.monotonic()
    while True:
        if os.path.exists(path):
            with open(path, "rb") as f:
                return json.loads(f.read())
        if os.path.exists(gone) or os.getppid() != agent:  # discarded, or the torchrun agent is gone
            return None
        if time.monotonic() - checked > 1.0:
            if not _alive(supervisor):
                return None
            checked = time.monotonic()
        time.sleep(PLAN_POLL_S)


def _enter_segment(config: dict, plan: dict) -> None:
    """Take on the segment's environment: all of it from a pipe; from a file (a torchrun rank) only the
    per-segment variables, since the rest is torchrun's own for this rank and the base the supervisor checked."""
    if plan.get("cwd"):
        os.chdir(plan["cwd"])
    if not _ranked(config) and config.get("park") != "plan":
        os.environ.clear()
        os.environ.update(plan["env"])
        return
    for key in [k for k in os.environ if k.startswith(PER_SEGMENT_PREFIX) or k == PARKED_PLAN_VARIABLE]:
        del os.environ[key]
    os.environ.update({k: v for k, v in plan["env"].items() if k.startswith(PER_SEGMENT_PREFIX)})


def park_at_plan(config: dict) -> None:
    """Run the command from its first line; park where it first asks for its launch plan (see module docstring)."""
    kind, name = config["target"]
    argv = [name, *config.get("argv", [])]
    sys.path[0] = os.path.dirname(os.path.realpath(name)) if kind == "path" else os.getcwd()
    file = os.path.abspath(name) if kind == "path" else None
    t0 = time.monotonic()

    def wait(extra: dict | None = None) -> None:
        os.environ.__class__ = os._Environ  # type: ignore[attr-defined]
        report = {
            **(extra or {}),
            "pid": os.getpid(),
            "park": "plan",
            "imports_s": time.monotonic() - t0,
            "imported": len(sys.modules),
            "failed": [],
            "early_reads": list(_WatchedEnviron.early_reads),
            "files": code_files([file] if file else []),
        }
        _write_ready(config, report)
        plan = _read_plan(config)
        if plan is None:  # discarded unused, or the supervisor went away: nothing of the script's may run on
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _enter_segment(config, {**plan, "cwd": None})  # the script may have changed directory itself

    hook = types.ModuleType(PARK_MODULE)
    hook.wait = wait  # type: ignore[attr-defined]
    hook.preload = config.get("preload")  # type: ignore[attr-defined]
    # Seconds left before the supervisor gives up on this standby reaching its park point (a preload's first
    # read must not use them up: a standby killed there makes later ones park at their imports).
    timeout = float(config.get("park_timeout_seconds", 300.0))
    hook.park_seconds_left = lambda: timeout - (time.monotonic() - t0)  # type: ignore[attr-defined]
    sys.modules[PARK_MODULE] = hook
    os.environ.__class__ = _WatchedEnviron
    run_target(kind, argv)


def main(config: dict) -> None:
    if config.get("park") == "plan":
        park_at_plan(config)
        return
    report, _ = park(config)
    _write_ready(config, report)
    plan = _read_plan(config)
    if plan is None:
        sys.exit(0)  # discarded unused, or the supervisor went away
    _enter_segment(config, plan)
    kind, name = config["target"]
    run_target(kind, [name, *plan["argv"]])


if __name__ == "__rbs_standby__":  # python -c BOOTSTRAP <this file> <config>
    main(json.loads(sys.argv[2]))
elif __name__ == "__main__":  # a torchrun rank: python -u <this file> <config>
    main(json.loads(sys.argv[1]))
