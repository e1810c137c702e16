class DualFlowUserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2."""
