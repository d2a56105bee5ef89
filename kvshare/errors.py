"""Exceptions shared across packages."""


class UserError(Exception):
    """An error the user can act on: the CLI prints its message without a traceback."""
