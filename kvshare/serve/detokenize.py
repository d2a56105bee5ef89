"""Incremental detokenisation with stop strings, for streaming.

Text is emitted as soon as it is final: a token that ends inside a multi-byte
character (decoded as U+FFFD) is held back, and so is any tail that could be
the start of a stop string::

    generated  "Hello wor"   stop ["world"]
    emitted    "Hello "      held "wor" (could become "world")
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self._decode = decode
        self._stops = stops
        self._token_ids: list[int] = []
        self._emitted = 0  # characters of the final text already handed out
        self.text = ""
        self.is_stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly final text (maybe empty)."""
        self._token_ids.append(token_id)
        text = self._decode(self._token_ids)
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0:
                self.text = text[:at]
                self.is_stopped = True
                return self._take(len(self.text))
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for stop in self._stops:
            for k in range(min(len(stop) - 1, safe), 0, -1):
                if text[:safe].endswith(stop[:k]):
                    safe -= k
                    break
        return self._take(safe)

    def finish(self) -> str:
        """Whatever was held back, at the end of generation."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece = self.text[self._emitted : upto]
        self._emitted = upto
        return piece
