"""A script whose loss falls to 1.0 by iteration 30, then drifts up by 0.01 an iteration; it imports nothing of ours.

    python drift.py --out_dir=out --max_iters=110
    python drift.py --out_dir=out --init_from=resume

The loss is a function of the iteration alone, so a test knows where a divergence detector must fire: with
factor 1.5 over the best rolling mean (about 1.0, set before iteration 40), from about iteration 83 on. A
detector that starts cold after a resume at iteration 50 or 60 takes its best from there (1.2 to 1.3) and
would not fire before iteration 110. Saves `{"iter": N}` to `out_dir/state.json` every 10 iterations, in place,
and prints one `iter N: loss X` line per iteration.
"""

import json
import os
import sys
import time

config = {"out_dir": "out", "init_from": "scratch", "max_iters": 110, "iter_time": 0.01}
for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in config:
        sys.exit(f"unknown option --{key}")
    config[key] = type(config[key])(value)

path = os.path.join(config["out_dir"], "state.json")
it = 0
if config["init_from"] == "resume":
    with open(path) as f:
        it = json.load(f)["iter"]
    print(f"resuming from {path} at iter {it}")
os.makedirs(config["out_dir"], exist_ok=True)
while True:
    if it > 0 and (it % 10 == 0 or it == config["max_iters"]):
        with open(path, "w") as f:
            json.dump({"iter": it}, f)
    if it >= config["max_iters"]:
        break
    loss = 2.0 - it / 30 if it < 30 else 1.0 + 0.01 * (it - 30)
    print(f"iter {it}: loss {loss:.6g}")
    it += 1
    time.sleep(config["iter_time"])
print("done")
