"""A forked child of a process that ran a Prefect flow must exit cleanly (a workaround for Prefect 3.8).

Prefect registers each of its queue services (the log and event workers) with `threading._register_atexit`,
and resets every service in a forked child (`os.register_at_fork`, PrefectHQ/prefect#19116). The reset sets
`_done_event` to None but leaves the inherited exit hook, which then asserts `_done_event is not None` when
the child's threads shut down. The child exits with code 1 and no trace: a `DataLoader` worker forked by a
notebook or a test after a flow ran in the same process then fails with "worker exited unexpectedly".

`install()` drops, in the child only, the exit hooks of the services it inherited: they were reset and have
nothing to drain. Hooks that services started in the child register afterwards are kept.
`tests/test_prefect_fork.py` checks that the bug is still there without this; remove the module when not.
"""

from __future__ import annotations

import os
import threading

_installed = False


def _drop_inherited_service_exit_hooks() -> None:
    from prefect._internal.concurrency.services import _QueueServiceBase

    hooks = getattr(threading, "_threading_atexits", None)
    if hooks is None:  # a Python without the private list: nothing to drop
        return

    def inherited_service(hook) -> bool:  # threading wraps each hook in a functools.partial
        method = getattr(hook, "func", hook)
        return isinstance(getattr(method, "__self__", None), _QueueServiceBase)

    hooks[:] = [hook for hook in hooks if not inherited_service(hook)]


def install() -> None:
    """Register the child-side clean-up once per process (idempotent)."""
    global _installed
    if not _installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_drop_inherited_service_exit_hooks)
        _installed = True
