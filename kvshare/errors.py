"""Exceptions shared across packages."""


class UserError(Exception):
    """An error the user can act on: the CLI prints its message without a traceback."""


class RequestCancelled(Exception):
    """A request given up before it ended: its client left, or the replica is stopping (raised by the engine
    between two layers of a prefill when its RequestOptions.is_cancelled says so)."""
