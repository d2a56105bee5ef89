"""A spy on the one page check (kvshare.pool.checksum.checksum_is_valid), wherever a module bound it.

``spy_verdicts(monkeypatch, forced)`` replaces the function in kvshare.pool.checksum (so ``is_valid``
and PageHasher call the spy) and in every loaded kvshare module that imported it by name. Each call
is recorded; ``forced`` None answers as the real check does, True/False answers that instead. A path
that compared a checksum on its own would neither be recorded nor follow a forced answer, which is
what the tests that use this catch.
"""

from __future__ import annotations

import sys

from kvshare.pool import checksum


def spy_verdicts(monkeypatch, forced: bool | None = None) -> list[tuple[int, int]]:
    """Route every page check through a spy; the (recorded, computed) checksum of each call, in order."""
    real = checksum.checksum_is_valid
    calls: list[tuple[int, int]] = []

    def spy(header, computed: int) -> bool:
        calls.append((header.checksum, computed))
        return real(header, computed) if forced is None else forced

    for name, module in list(sys.modules.items()):
        if name.startswith("kvshare") and getattr(module, "checksum_is_valid", None) is real:
            monkeypatch.setattr(module, "checksum_is_valid", spy)
    return calls
