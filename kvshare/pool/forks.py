"""Which process an object belongs to: a count of the fork() calls this process descends from.

A hold table and a pool connection belong to the process that made them; a forked child inherits both and must use
neither (direct_reader.py, client.py). Comparing the count kept at creation with ``fork_count()`` tells an
inherited object apart for the price of reading an int, where ``os.getpid()`` is a system call on every lookup
(glibc caches no pid: 0.2 us on a quiet host, 1.4 us measured on a busy 2-core one).
"""

from __future__ import annotations

import os

_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


def fork_count() -> int:
    """The fork() calls (os.fork, multiprocessing's fork) between this interpreter's start and this process."""
    return _forks
