"""The router's hint sender to a replica's hint listener, over a Unix socket: verified hints arrive, others are
refused and counted, and nothing the sender does waits for the replica."""

import asyncio
import os
import socket
import threading
import time

import pytest

from kvshare.integrations.vllm.hint_listener import HintListener
from kvshare.router.hint_sender import HintSender
from kvshare.router.hints import encode_hint, make_hint

KEY = "s" * 32


class Inbox:
    def __init__(self) -> None:
        self.hints, self.refused, self.ticks = [], [], 0
        self.changed = threading.Event()

    def on_hint(self, hint) -> None:
        self.hints.append(hint)
        self.changed.set()

    def on_refused(self, why: str) -> None:
        self.refused.append(why)
        self.changed.set()

    def on_tick(self) -> None:
        self.ticks += 1

    def wait(self, predicate, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate() and time.monotonic() < deadline:
            self.changed.wait(0.05)
            self.changed.clear()
        assert predicate()


@pytest.fixture
def listener(tmp_path):
    inbox = Inbox()
    path = str(tmp_path / "hints.sock")
    listener = HintListener(path, KEY, inbox.on_hint, inbox.on_refused, inbox.on_tick, tick_s=0.01)
    listener.start()
    try:
        yield path, inbox
    finally:
        listener.close()
    assert not os.path.exists(path)


def test_hints_sent_by_the_router_arrive_verified(listener):
    path, inbox = listener
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"

    async def send():
        sender = HintSender([path, None], KEY)
        sender.start()
        await asyncio.sleep(0.2)  # the connection opens in the background
        assert sender.send(0, make_hint("m", "salt", list(range(700))))
        assert not sender.send(1, make_hint("m", "", [1]))  # that replica takes no hints
        await asyncio.sleep(0.2)
        await sender.close()
        return sender.counts

    counts = asyncio.run(send())
    inbox.wait(lambda: len(inbox.hints) == 1)
    assert inbox.hints[0].tokens().tolist() == list(range(700)) and inbox.hints[0].cache_salt == "salt"
    assert counts["sent"] == 1 and inbox.refused == [] and inbox.ticks > 0


def test_a_sender_that_cannot_connect_drops_hints_without_waiting(tmp_path):
    async def send():
        sender = HintSender([str(tmp_path / "nobody.sock")], KEY)
        started = time.perf_counter()
        went = [sender.send(0, make_hint("m", "", [1, 2])) for _ in range(3)]
        elapsed = time.perf_counter() - started
        await asyncio.sleep(0.05)
        await sender.close()
        return went, elapsed, sender.counts

    went, elapsed, counts = asyncio.run(send())
    assert went == [False] * 3 and counts["dropped"] == 3 and elapsed < 0.1


def test_forged_and_unsigned_frames_are_refused_and_the_connection_goes_on(listener):
    path, inbox = listener
    forged = encode_hint(make_hint("m", "", [5, 6]), "f" * 32)  # signed with another key
    tampered = bytearray(encode_hint(make_hint("m", "", [5, 6]), KEY))
    tampered[-3] ^= 1
    good = encode_hint(make_hint("m", "", [7, 8]), KEY)
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(path)
        conn.sendall(forged + bytes(tampered) + b"\x00\x00\x00\x03abc" + good)
        inbox.wait(lambda: len(inbox.hints) == 1 and len(inbox.refused) == 3)
    assert inbox.hints[0].tokens().tolist() == [7, 8]
    with socket.socket(socket.AF_UNIX) as conn:  # a frame over the bound ends its connection
        conn.connect(path)
        conn.sendall((1 << 30).to_bytes(4, "big"))
        inbox.wait(lambda: len(inbox.refused) == 4)


def test_a_listener_without_a_key_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="account_key_file"):
        HintListener(str(tmp_path / "h.sock"), "", lambda h: None, lambda w: None)
