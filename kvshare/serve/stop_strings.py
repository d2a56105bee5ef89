"""Stop strings found as generated text arrives: Knuth-Morris-Pratt, one state per stop string.

Each stop string keeps the length of the longest tail of the text so far that is a prefix of it (its
state); a new character extends that tail or falls back along the string's failure table::

    stop      "abab"         failure [0, 0, 1, 2]   (the longest proper border of stop[: i + 1])
    text      "... x a b a"  state 3: "aba" may begin the stop, so those 3 characters are held back
    + "b"                    state 4 = len(stop): the stop ends here and began 3 characters before

The text is looked at once, in the order it arrives: a token costs time linear in the characters it adds
(amortised over the generation: a state falls back at most as far as it rose), whatever the stop strings'
lengths, and memory is one table of len(stop) integers per stop string, not every prefix of it.
"""

from __future__ import annotations


def failure_table(stop: str) -> list[int]:
    """``table[i]``: the length of the longest proper prefix of ``stop[: i + 1]`` that is also its suffix."""
    table = [0] * len(stop)
    border = 0
    for i in range(1, len(stop)):
        while border and stop[i] != stop[border]:
            border = table[border - 1]
        if stop[i] == stop[border]:
            border += 1
        table[i] = border
    return table


class StopMatcher:
    """Where the first stop string begins in a generated text fed in pieces, and how much of its tail to hold."""

    def __init__(self, stops: list[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string must not be empty")
        self._stops = stops
        self._failures = [failure_table(stop) for stop in stops]
        self._states = [0] * len(stops)
        self.num_scanned = 0  # characters stepped, one per stop string: linear in the text's length

    @property
    def num_held(self) -> int:
        """The longest tail of the text so far that may still begin a stop string (never a whole one)."""
        return max(self._states, default=0)

    def find(self, piece: str) -> int | None:
        """Feed the next ``piece`` of text; the start, counted from the start of ``piece`` (negative: it began
        in earlier text), of the stop string that begins first among those ending in ``piece``, else None.

        Once it returns a start the text is over: later calls see states past that stop.
        """
        earliest: int | None = None
        for s, stop in enumerate(self._stops):
            failure, state = self._failures[s], self._states[s]
            for i, char in enumerate(piece):
                while state and stop[state] != char:
                    state = failure[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):  # this stop's first end in the piece: its earliest start there
                    start = i + 1 - len(stop)
                    earliest = start if earliest is None else min(earliest, start)
                    break
            self._states[s] = state
            self.num_scanned += len(piece)
        return earliest
