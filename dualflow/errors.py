"""
The exceptions the `dualflow` CLI ends with one line: the user's mistakes and Ctrl-C. Anything else is a bug in our code
and keeps its traceback.
"""


class DualFlowUserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2."""


class DualFlowInterrupted(KeyboardInterrupt):
    """Ctrl-C with something to say (what was kept, how to go on): the CLI prints it on one line, exit status 130."""
