"""The usage chunk a vLLM stream ends with, for pool_aware's calibration, whether or not the client asked for it.

A vLLM stream says how many prompt tokens its replica did not compute only in its usage chunk
(``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``, which ``kvshare up
--engine vllm`` passes); vLLM 0.26 and 0.32 put no ``kv_transfer_params`` into a streamed chunk. So the router
asks for it (``ask_for_usage``: ``stream_options.include_usage``) where the client did not, and gives the
client the stream vLLM would have sent it (``UsageStrip``). Asked for, vLLM changes two things, in both
versions: it sends the usage chunk (``"choices":[]``, before ``[DONE]``), and it leaves ``system_fingerprint``
off the terminal chunk (the one with a ``finish_reason``), which it otherwise ends with::

    asked:    {..,"choices":[{.."finish_reason":"length"..}]}
              {..,"choices":[],"usage":{..},"system_fingerprint":"fp"}
              [DONE]
    unasked:  {..,"choices":[{.."finish_reason":"length"..}],"system_fingerprint":"fp"}
              [DONE]

Only a stream of one prompt and one choice is asked for (then there is one terminal chunk, followed by the
usage chunk); a client that asked for usage, or for continuous usage stats, gets vLLM's stream untouched.
Pure functions of bytes; no value of the body but these is decoded.
"""

from __future__ import annotations

import msgspec

from kvshare.router.accounts import ACCOUNT_PATHS

_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)
_FINGERPRINT = b'"system_fingerprint":'


def ask_for_usage(method: str, path: str, body: bytes) -> bytes | None:
    """``body`` with ``stream_options.include_usage`` on, for a streamed completion of one prompt and one choice
    whose client did not ask for usage; None for any other request (its body goes on as it is)."""
    if method != "POST" or path not in ACCOUNT_PATHS or b'"stream"' not in body:
        return None
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        stream, n, options = (msgspec.json.decode(fields.get(k, b"null")) for k in ("stream", "n", "stream_options"))
    except _DECODE_ERRORS:
        return None  # the replica answers a bad body
    if stream is not True or n not in (None, 1) or not (options is None or isinstance(options, dict)):
        return None
    options = options or {}
    if options.get("include_usage") or options.get("continuous_usage_stats"):
        return None  # the client reads the usage (or asked for what asking would change)
    if path == "/v1/completions" and not _is_one_prompt(memoryview(fields.get("prompt", b"null"))[:64].tobytes()):
        return None
    fields["stream_options"] = msgspec.Raw(msgspec.json.encode({**options, "include_usage": True}))
    return msgspec.json.encode(fields)


def _is_one_prompt(head: bytes) -> bool:
    """A completion's ``prompt``, by its first bytes, is one prompt: a string or a list of token ids (not a list
    of prompts)."""
    head = head.lstrip()
    if head[:1] == b'"':
        return True
    return head[:1] == b"[" and head[1:].lstrip()[:1] not in (b'"', b"[", b"{", b"]", b"")


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: dict | None = None
    system_fingerprint: msgspec.Raw = msgspec.Raw()  # empty: none


class UsageStrip:
    """A stream whose usage chunk the router asked for, as vLLM would have sent it unasked: ``feed`` each piece
    of the replica's stream, pass on what it returns, then what ``close`` returns. Whole events pass on as they
    come; from the terminal chunk on they wait for the usage chunk (the next event), which is taken out, its
    ``system_fingerprint`` put back on the terminal chunk. A stream that ends without one is passed on whole."""

    def __init__(self) -> None:
        self._partial = b""  # the start of an event whose end has not come
        self._held: list[bytes] = []  # whole events from the terminal chunk on

    def feed(self, data: bytes) -> bytes:
        data = self._partial + data
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self._partial = data
            return b""
        self._partial = data[end:]
        out = []
        for event in data[:end].split(b"\n\n")[:-1]:
            event += b"\n\n"
            chunk = _chunk(event)
            if chunk is not None and chunk.usage is not None and not chunk.choices:
                out += [_stamped(e, chunk.system_fingerprint) for e in self._held]
                self._held = []
            elif self._held or (chunk is not None and any(c.finish_reason is not None for c in chunk.choices)):
                self._held.append(event)
            else:
                out.append(event)
        return b"".join(out)

    def close(self) -> bytes:
        rest, self._held, self._partial = b"".join(self._held) + self._partial, [], b""
        return rest


def _chunk(event: bytes) -> _Chunk | None:
    """The fields of a data event that may be the terminal or the usage chunk; a token's chunk (its one choice
    unfinished, ``"finish_reason":null``) is not decoded."""
    if not event.startswith(b"data: {"):
        return None
    if b'"usage":' not in event and (b'"finish_reason":' not in event or b'"finish_reason":null' in event):
        return None
    try:
        return msgspec.json.decode(event[len(b"data: ") :], type=_Chunk)
    except _DECODE_ERRORS:
        return None


def _stamped(event: bytes, fingerprint: msgspec.Raw) -> bytes:
    """A terminal chunk's event ending with ``"system_fingerprint":...`` as vLLM serializes it (the last field it
    sets on a terminal chunk), unless there is none to put or it has one."""
    body = event[: -len(b"\n\n")]
    if bytes(fingerprint) in (b"", b"null") or not body.endswith(b"}") or _FINGERPRINT in body:
        return event
    return body[:-1] + b"," + _FINGERPRINT + bytes(fingerprint) + b"}\n\n"
