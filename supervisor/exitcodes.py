"""Exit codes of a supervised training process; docs/reliability.md documents them."""

EXIT_OK = 0  #: training finished
EXIT_FAILED = 1  #: an error in the training code (a traceback on stderr)
EXIT_USAGE = 2  #: a set-up mistake the supervisor refused (one `error:` line on stderr, no traceback)
EXIT_STOPPED = 3  #: stopped at the supervisor's request or by a `stop` rule; checkpoint saved
EXIT_PREEMPTED = 75  #: preempted (SIGTERM or a provider notice); emergency checkpoint saved
EXIT_ANOMALY = 76  #: an anomaly was seen in process and reported; the supervisor decides what next

DESCRIPTIONS = {
    EXIT_OK: "finished",
    EXIT_FAILED: "failed",
    EXIT_USAGE: "refused: a set-up mistake",
    EXIT_STOPPED: "stopped (checkpoint saved)",
    EXIT_PREEMPTED: "preempted (emergency checkpoint saved)",
    EXIT_ANOMALY: "anomaly reported (supervisor decides)",
}
