"""The exit classifier's evidence table: log-line patterns and signal rules, as data.

Higher `priority` wins when several rules match one exit. Policies add rows through
`monitor.classifier_patterns: [{type, pattern, priority?}]`; their default priority (100) beats
every built-in row. Regexes are matched case-insensitively, line by line (`re.MULTILINE`).
"""

from __future__ import annotations

from policies.monitor_schema import ClassifierPattern

#: NVIDIA Xid codes caused by the application, not the hardware (the rule NVIDIA's k8s device plugin uses).
APPLICATION_XIDS = (13, 31, 43, 45, 68)
_APP = "|".join(str(x) for x in APPLICATION_XIDS)
# "NVRM: Xid (PCI:0000:3b:00): 79, pid=...", "Xid 79", "XID error 48": skip the PCI address, read the code.
_XID = r"\bXid\b\s*(?:errors?\b\s*)?(?:\([^)]*\))?\s*:?\s*"

#: Log-line rules. `name` is what the evidence reports.
PATTERNS: tuple[dict, ...] = (
    # Hardware: the GPU, its memory, or the node is broken; relaunching on the same node will fail again.
    {
        "name": "gpu_off_bus",
        "type": "hardware_fault",
        "priority": 90,
        "pattern": r"fallen off the bus|\bGPU is lost\b",
    },
    {
        "name": "xid_hardware",
        "type": "hardware_fault",
        "priority": 90,
        "pattern": _XID + rf"(?!(?:{_APP})\b)\d+\b",
    },
    {
        "name": "ecc_uncorrectable",
        "type": "hardware_fault",
        "priority": 90,
        "pattern": r"uncorrectable ECC error|double bit error|\(DBE\)",
    },
    {"name": "slurm_node_fail", "type": "hardware_fault", "priority": 90, "pattern": r"DUE TO NODE FAIL"},
    # Memory: shm exhaustion surfaces as SIGBUS, so it must outrank the SIGBUS rule.
    {
        "name": "shm_exhausted",
        "type": "oom",
        "priority": 88,
        "pattern": r"insufficient shared memory|out of shared memory",
    },
    # Application faults that look like hardware ones. Not bare "device-side assert": every CUDA
    # error message also says "Compile with TORCH_USE_CUDA_DSA to enable device-side assertions".
    {
        "name": "device_side_assert",
        "type": "software_error",
        "priority": 85,
        "pattern": r"device-side assert triggered|\.cu:\d+: .*Assertion .* failed",
    },
    {"name": "xid_application", "type": "software_error", "priority": 80, "pattern": _XID + rf"(?:{_APP})\b"},
    {
        "name": "cuda_oom",
        "type": "oom",
        "priority": 80,
        "pattern": r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED",
    },
    {
        "name": "host_oom",
        "type": "oom",
        "priority": 80,
        "pattern": r"DefaultCPUAllocator: can't allocate memory|^MemoryError\b|Out of memory: Kill(?:ed)? process",
    },
    {
        "name": "illegal_memory_access",
        "type": "hardware_fault",
        "priority": 70,
        "pattern": r"CUDA error: an illegal memory access",
    },
    {
        "name": "nccl_watchdog_timeout",
        "type": "hardware_fault",
        "priority": 70,
        "pattern": r"Watchdog caught collective operation timeout",
    },
    {"name": "nccl_ib_error", "type": "hardware_fault", "priority": 65, "pattern": r"NET/IB\b.*\berror\b"},
    {
        "name": "torchrun_child_sigbus",
        "type": "hardware_fault",
        "priority": 60,
        "pattern": r"Signal 7 \(SIGBUS\) received by PID|exitcode\s*:\s*-7\b",
    },
    # Scheduler terminations: the job can resume from its last checkpoint.
    {"name": "slurm_preempted", "type": "preemption", "priority": 60, "pattern": r"DUE TO PREEMPTION"},
    {"name": "slurm_time_limit", "type": "preemption", "priority": 60, "pattern": r"DUE TO TIME LIMIT"},
    {
        "name": "torchrun_sigterm",
        "type": "preemption",
        "priority": 40,
        "pattern": r"got signal: 15\b|Signal 15 \(SIGTERM\) received by PID",
    },
    # A rank that saved an emergency checkpoint exits 75 (EXIT_PREEMPTED); torchrun itself then exits 1.
    {
        "name": "torchrun_child_preempted",
        "type": "preemption",
        "priority": 40,
        "pattern": r"exitcode\s*:\s*75\b",
    },
    # torchrun's elastic errors across nodes. A rendezvous that timed out means a node never joined, and a
    # lost connection to the c10d store means the node hosting it vanished: the infrastructure, not the code.
    {
        "name": "torchrun_rendezvous_timeout",
        "type": "hardware_fault",
        "priority": 50,
        "pattern": r"\bRendezvousTimeoutError\b",
    },
    {
        "name": "torchrun_store_lost",
        "type": "hardware_fault",
        "priority": 50,
        "pattern": r"\bRendezvousConnectionError\b|connection to the C10d store has failed",
    },
    # A rendezvous another agent closed, a peer rank whose sockets closed (gloo), a checkpoint group's lost
    # rank: this process is a casualty; the failed peer's own exit says why. Above the traceback they print.
    {
        "name": "torchrun_rendezvous_closed",
        "type": "unknown_exit",
        "priority": 25,
        "pattern": r"\bRendezvousClosedError\b",
    },
    {
        "name": "peer_rank_lost",
        "type": "unknown_exit",
        "priority": 15,
        "pattern": r"Connection reset by peer|Connection closed by peer|\bRankLost\b"
        r"|Timed out waiting \d+ms for (?:recv|send) operation",
    },
    # A SIGKILLed child makes torchrun print a traceback; that traceback is not the user's bug.
    {
        "name": "torchrun_child_sigkill",
        "type": "unknown_exit",
        "priority": 20,
        "pattern": r"Signal 9 \(SIGKILL\) received by PID|exitcode\s*:\s*-9\b",
    },
    {
        "name": "python_traceback",
        "type": "software_error",
        "priority": 10,
        "pattern": r"^Traceback \(most recent call last\):",
    },
)

#: How the process ended, when it ended by a signal (Popen's negative return code, or 128+N).
SIGNAL_RULES: tuple[dict, ...] = (
    {"name": "sigbus", "signal": "SIGBUS", "type": "hardware_fault", "priority": 60},
    {"name": "sigterm", "signal": "SIGTERM", "type": "preemption", "priority": 40},
    {"name": "sigkill", "signal": "SIGKILL", "type": "unknown_exit", "priority": 20},
)

#: Rules from outside the log: a provider notice was seen, or the cgroup counted an OOM kill.
NOTICE_RULE = {"name": "preemption_notice", "type": "preemption", "priority": 45}
CGROUP_OOM_RULE = {"name": "cgroup_oom_kill", "type": "oom", "priority": 80}
#: Priority of a policy-supplied pattern that does not name its own: the schema's default, defined there once.
DEFAULT_EXTRA_PRIORITY: int = ClassifierPattern.model_fields["priority"].default
