"""What a pool client raises (kvshare.pool.client re-exports them): the pool cannot be reached, it refused a
request, or a page failed its check."""

from __future__ import annotations


class PoolUnavailable(ConnectionError):
    """The pool daemon cannot be reached (not started, stopped or crashed)."""


class PoolRequestError(RuntimeError):
    """The daemon refused a request; ``code`` says why in one word."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ChecksumMismatch(RuntimeError):
    """A page's bytes do not match the checksum recorded at commit."""
