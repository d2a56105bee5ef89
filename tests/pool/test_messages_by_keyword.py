"""Every message that crosses a process boundary is built by keyword: several carry fields of one type (Reserve's
namespace, tokens, account and parent key are all bytes), so a positional build would silently swap them when
the protocol's fields are reordered."""

from __future__ import annotations

import msgspec
import pytest

from kvshare.pool import events, protocol


def _messages():
    for module in (protocol, events):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == module.__name__:
                yield value


@pytest.mark.parametrize("message", list(_messages()), ids=lambda m: f"{m.__module__}.{m.__name__}")
def test_a_message_with_fields_refuses_positional_arguments(message):
    """Fails when a message class accepts its fields by position (not ``kw_only``)."""
    if not message.__struct_fields__:
        return  # nothing to swap
    with pytest.raises(TypeError):
        message(*range(len(message.__struct_fields__)))


def test_keyword_only_messages_keep_their_wire_order():
    """An array-like message still encodes its fields in declared order."""
    header = protocol.PageHeader(offset=1, page_bytes=2, checksum=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(header)) == [1, 2, 3, protocol.FORMAT_VERSION, 1]
    batch = events.EventBatch(ts=1.5, events=[events.all_blocks_cleared("positional")], data_parallel_rank=0)
    assert msgspec.msgpack.decode(events.encode_batch(batch)) == [1.5, [["AllBlocksCleared"]], 0]
    assert events.decode_batch(events.encode_batch(batch), "positional") == batch
