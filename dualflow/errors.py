"""
The exceptions the `dualflow` CLI ends with one line: the user's mistakes, Ctrl-C and SIGTERM. Anything else is a bug in
our code and keeps its traceback.
"""

import os
import signal
import threading
from contextlib import contextmanager


class DualFlowUserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2."""


class DualFlowInterrupted(KeyboardInterrupt):
    """Ctrl-C with something to say (what was kept, how to go on): the CLI prints it on one line, exit status 130."""


class DualFlowTerminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a job scheduler) or SIGHUP (the terminal or SSH session closed), raised like Ctrl-C
    so that the same cleanup runs."""


# The signals that end a run like Ctrl-C (the CLI reports which one).
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class SignalState:
    signum: int | None = None  # the terminating signal received, if any
    interrupted: bool = False  # Ctrl-C (SIGINT) received


@contextmanager
def terminating_signals_as_interrupt():
    """
    `with terminating_signals_as_interrupt() as state:` a SIGTERM or SIGHUP raises DualFlowTerminated in the block
    (and sets `state.signum`), so whatever a Ctrl-C cleans up is cleaned up too; a second such signal during that
    cleanup is ignored. A Ctrl-C raises KeyboardInterrupt as by default and sets `state.interrupted`: native code
    (safetensors' reads) can turn the interrupt into an error of its own, which the caller can then tell apart from a
    bug. Nothing changes for a signal the program handles itself, or outside the main thread (signals reach only it);
    a process forked in the block still dies of these signals as by default.
    """
    state = SignalState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    handled = [signum for signum in TERMINATING_SIGNALS if signal.getsignal(signum) == signal.SIG_DFL]
    pid = os.getpid()

    def terminate(signum, frame):
        if os.getpid() != pid:  # a forked worker (DataLoader, pool): the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for other in handled:
            signal.signal(other, signal.SIG_IGN)
        state.signum = signum
        raise DualFlowTerminated()

    def interrupt(signum, frame):
        state.interrupted = True
        signal.default_int_handler(signum, frame)

    for signum in handled:
        signal.signal(signum, terminate)
    ctrl_c_default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ctrl_c_default:
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield state
    finally:
        for signum in handled:
            signal.signal(signum, signal.SIG_DFL)
        if ctrl_c_default:
            signal.signal(signal.SIGINT, signal.default_int_handler)
