"""Framework integrations: callbacks that put a Lightning or Hugging Face Trainer run under supervision.

Each is a thin driver over `supervisor.runtime.core.TrainingCore`, as `Session.loop()` is. Import the
submodule you need (`supervisor.integrations.lightning`, `supervisor.integrations.transformers`): importing
this package imports neither framework.
"""
