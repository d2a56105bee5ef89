"""What the router writes into the body it forwards to a vLLM replica: the pool account and the tenant's cache_salt.

A vLLM replica sees no API key or tenant header of its own, so the router, which authenticates, names them:

- the account (kvshare.serve.tenancy.account_identity: the API key, else the tenant header) in
  ``kv_transfer_params["kvshare"]`` with its tag under the key the router and the replicas share,
  replacing whatever the client wrote there. The connector (kvshare.integrations.vllm.options) takes an
  account only with a valid tag, so no client chooses its own account.
- the ``cache_salt``: the tenant's namespace salt (kvshare.serve.tenancy.vllm_cache_salt), replacing the
  client's, which only splits its own tenant's share. vLLM keys its prefix cache by it and the connector
  its pool namespace, so two tenants never share a page or a prefix-cache block, whatever they send. A
  body that cannot be salted is refused here (BodyRefused), never passed on with the client's salt.

Pure functions of the body; values other than these two are kept as raw bytes, never decoded.
"""

from __future__ import annotations

import msgspec

from kvshare.serve.tenancy import account_tag, namespace_salt, vllm_cache_salt

ACCOUNT_PATHS = ("/v1/completions", "/v1/chat/completions")  # the requests whose KV a replica stores
PARAMS_KEY = "kvshare"  # the connector's entry in kv_transfer_params (kvshare.integrations.vllm.options)
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


class BodyRefused(ValueError):
    """A body a tenant's request to a vLLM replica cannot carry its salt in; the message names the fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def replica_salt(engine: str, tenant: str | None, cache_salt: str | None) -> str:
    """The salt of a request's keys on a replica ("": none): what a built-in replica derives itself, what the
    router writes for vLLM replicas with tenants, else (``tenant`` None) the client's own cache_salt."""
    if engine != "vllm":
        return namespace_salt(tenant or "", cache_salt)
    return (cache_salt if tenant is None else vllm_cache_salt(namespace_salt(tenant, cache_salt))) or ""


def vllm_body(method: str, path: str, body: bytes, key: str, account: str, tenant: str | None) -> bytes:
    """The body a vLLM replica gets. ``key``: the account key, with which a completion names ``account``
    ("": none is signed); ``tenant``: the authenticated tenant identity whose salt every POST /v1/ body carries,
    None: no tenants (the client's cache_salt goes on). Raises BodyRefused where a tenant's body cannot carry it."""
    signs = bool(key) and method == "POST" and path in ACCOUNT_PATHS
    salts = tenant is not None and method == "POST" and path.startswith("/v1/")  # any endpoint vLLM salts
    if not (signs or salts):
        return body
    try:
        # the other values stay raw bytes: a prompt of 128k token ids decoded into Python ints took 50-70 ms
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except _DECODE_ERRORS:
        if salts:
            raise BodyRefused("the request body must be a JSON object") from None
        return body  # the replica refuses it
    if salts:
        _salt(fields, tenant)
    if signs and not _sign(fields, account, account_tag(key, account)):
        if salts:
            raise BodyRefused("kv_transfer_params must be a JSON object", param="kv_transfer_params")
        return body
    return msgspec.json.encode(fields)


def _salt(fields: dict[str, msgspec.Raw], tenant: str) -> None:
    """Sets ``cache_salt`` to the tenant's (none for the shared namespace: "" and no client salt)."""
    try:
        client_salt = msgspec.json.decode(fields.get("cache_salt", b"null"))
    except _DECODE_ERRORS:
        client_salt = 0  # refused below
    if client_salt is not None and (not isinstance(client_salt, str) or not client_salt):
        raise BodyRefused("cache_salt must be a non-empty string if given", param="cache_salt")
    salt = vllm_cache_salt(namespace_salt(tenant, client_salt))
    fields.pop("cache_salt", None)
    if salt is not None:
        fields["cache_salt"] = msgspec.Raw(msgspec.json.encode(salt))


def _sign(fields: dict[str, msgspec.Raw], account: str, tag: str) -> bool:
    """Writes ``account`` and its ``tag`` into kv_transfer_params["kvshare"], replacing any the client sent and
    keeping the rest; False when kv_transfer_params is not a JSON object (the replica refuses it)."""
    try:
        params = msgspec.json.decode(fields.get("kv_transfer_params", b"null"))
    except _DECODE_ERRORS:
        return False
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return False
    ours = params.get(PARAMS_KEY)
    params[PARAMS_KEY] = {**(ours if isinstance(ours, dict) else {}), "account": account, "account_tag": tag}
    fields["kv_transfer_params"] = msgspec.Raw(msgspec.json.encode(params))
    return True
