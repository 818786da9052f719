"""The error type of the ``mla-bridge`` commands."""


class CLIError(Exception):
    """A bad argument or an input the command refuses; the message names the flag. Exit code 2."""
