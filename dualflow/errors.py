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
    """SIGTERM (`kill`, `timeout`, a job scheduler), raised like Ctrl-C so that the same cleanup runs."""


class SigtermState:
    received = False


@contextmanager
def sigterm_as_interrupt():
    """
    `with sigterm_as_interrupt() as sigterm:` a SIGTERM raises DualFlowTerminated in the block (and sets
    `sigterm.received`), so whatever a Ctrl-C cleans up (a partial output folder) is cleaned up too; a second SIGTERM
    during that cleanup is ignored. Nothing changes where a program handles SIGTERM itself or outside the main
    thread (signals reach only it); a process forked in the block still dies of SIGTERM as by default.
    """
    state = SigtermState()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield state
        return
    pid = os.getpid()

    def terminate(signum, frame):
        if os.getpid() != pid:  # a forked worker (DataLoader, pool): the default action
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        state.received = True
        raise DualFlowTerminated()

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
