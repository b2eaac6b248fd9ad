"""Script mode: supervise a training command that does not use the training-side API (e.g. nanoGPT's train.py).

`output` and `template` are pure (the policy schema uses them to check a `script:` section at load time); the
rest is the runner's side: `mode` (the facade the runner calls), `relaunch`, `files`, `opaque`, `steps`, `tap`,
`watch`, `scanner` and `faults`. Nothing here is imported on load, so the schema's imports stay light.
"""
