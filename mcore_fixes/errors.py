"""Errors the command line reports as one clear line instead of a traceback."""


class UserError(Exception):
    """Bad input or an environment problem; nothing was changed. Exit status 2."""

    exit_code = 2


class CheckFailed(UserError):
    """The requested operation was checked and refused (conflict, dirty tree). Exit status 1."""

    exit_code = 1
