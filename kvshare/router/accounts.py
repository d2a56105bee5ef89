"""The pool account of a request to a vLLM replica, named by the router in the body it forwards.

A vLLM replica sees no API key or tenant header of its own, so the router writes the account it
authenticated (kvshare.serve.tenancy.account_identity: the API key, else the tenant header) into
``kv_transfer_params["kvshare"]`` with its tag under the key the router and the replicas share,
replacing whatever the client wrote there. The connector (kvshare.integrations.vllm.options) takes
an account only with a valid tag, so no client chooses its own account. Pure functions of the body.
"""

from __future__ import annotations

import msgspec

from kvshare.serve.tenancy import account_tag

ACCOUNT_PATHS = ("/v1/completions", "/v1/chat/completions")  # the requests whose KV a replica stores
PARAMS_KEY = "kvshare"  # the connector's entry in kv_transfer_params (kvshare.integrations.vllm.options)


def signed_body(key: str, method: str, path: str, account: str, body: bytes) -> bytes:
    """The body a vLLM replica gets for a request to ``path``: a completion's names ``account``, signed."""
    if method != "POST" or path not in ACCOUNT_PATHS:
        return body
    return with_account(body, account, account_tag(key, account))


def with_account(body: bytes, account: str, tag: str) -> bytes:
    """``body`` with ``kv_transfer_params["kvshare"]`` naming ``account`` and its ``tag``, replacing any the
    client sent; the rest of the body is kept. A body that is not a JSON object, or whose kv_transfer_params
    is not one, goes on as it is: the replica refuses it."""
    try:
        # the other values stay raw bytes: a prompt of 128k token ids decoded into Python ints took 50-70 ms
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        params = msgspec.json.decode(fields.get("kv_transfer_params", b"null"))
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return body
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return body
    ours = params.get(PARAMS_KEY)
    params[PARAMS_KEY] = {**(ours if isinstance(ours, dict) else {}), "account": account, "account_tag": tag}
    fields["kv_transfer_params"] = msgspec.Raw(msgspec.json.encode(params))
    return msgspec.json.encode(fields)
