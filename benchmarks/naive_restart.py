"""Child process of `bench rollback`: the naive restart, a plain script that `torch.load`s a `torch.save` file.

It is what the example would be without the supervisor: import torch and the model code, build, load the
model/optimizer/scheduler state dicts, run one step. The supervisor's runtime (and with it MLflow) is not
imported, so the baseline pays nothing for our machinery. Writes the wall-clock time the step finished.

    python -m benchmarks.naive_restart --state W/naive.pt --size 100M --out W/naive-0.json
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", default="100M")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    import torch
    import torch.nn.functional as F

    # The example imports the supervisor's Session at module level; a plain script would not.
    sys.modules.setdefault("supervisor.runtime", types.SimpleNamespace(Session=None))  # type: ignore[arg-type]
    from benchmarks.common import load_charlm

    charlm = load_charlm()
    imported = time.time()
    args = charlm.parse_args(["--size", a.size, "--batch-size", str(a.batch_size), "--steps", str(a.steps)])
    if a.threads:
        torch.set_num_threads(a.threads)
    charlm.deterministic()  # the same setup as the supervised example
    device = torch.device(a.device)
    model, opt, sched, loader, _ = charlm.build(args, device=device)
    built = time.time()
    state = torch.load(a.state, weights_only=True, map_location=device)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    loaded = time.time()
    x, y = next(iter(loader))
    x, y = x.to(device), y.to(device)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    loss.item()
    done = time.time()
    timings = {
        "started": STARTED,
        "done": done,
        "import_s": imported - STARTED,
        "build_s": built - imported,
        "load_s": loaded - built,
        "step_s": done - loaded,
    }
    a.out.write_text(json.dumps(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
