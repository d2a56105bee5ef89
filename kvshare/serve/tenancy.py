"""Who is asking: API-key authentication, and the tenant identity and cache_salt that salt the key namespace.

The tenant identity is part of every pool key (kvshare.keys.Namespace.tenant_salt), so
requests of two tenants never share a chunk: tenant B can neither reuse tenant A's
prefixes nor time them. Where the identity comes from::

    API keys set      "key:" + H(key)               the key decides; H keeps the key itself out of the salt
      + tenant header "key:" + H(key) + "/" + value  a key's holder may split its own namespace, never reach another's
    tenant header     value                          set by a trusted gateway in front of the replicas
    neither           ""                             one shared namespace

A request's ``cache_salt`` (vLLM's field: "requests with different salts never share cached KV")
splits its tenant's namespace further, in the local prefix cache and the pool alike::

    no cache_salt     tenant                         as above: unsalted requests keep their namespace
    cache_salt S      tenant + NUL "cache_salt=" + S  a salt reaches only its own tenant's share

Pool quotas are charged to the account, not to the salt: a client chooses its cache_salt
(and, with an API key, its tenant header), so an account per salt would let it hold a
quota per value it sends. The account is the authenticated identity alone::

    API keys set      "key:" + H(key)                the key, whatever tenant header it sends
    tenant header     value                          the gateway's word
    neither           ""                             one shared account

A vLLM replica sees no API key or tenant header of its own (the router authenticates), so the
router names the account in the body it forwards, ``kv_transfer_params["kvshare"]["account"]``,
with ``account_tag``: an HMAC under a key the router and the replicas share (``$KVSHARE_ACCOUNT_KEY``).
The connector takes an account only with a valid tag, so a client that reaches a replica directly
cannot choose one; without it the request is charged to the shared account.
It sets the request's ``cache_salt`` too, to ``vllm_cache_salt(namespace_salt(tenant, client's salt))``:
vLLM and the connector salt by cache_salt alone, so the tenant must be in it.

The NUL keeps the pairing one to one: a tenant identity never holds one (HTTP header values
cannot; key identities are hex), so no (tenant, salt) pair and no bare tenant spell the same salt.

Pure functions of the request's headers and the configuration.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

BEARER = "Bearer "


class Unauthorized(Exception):
    """The request carries no API key, or one that is not configured."""


def bearer_token(headers: Mapping[str, str]) -> str:
    header = headers.get("Authorization", "")
    return header[len(BEARER) :].strip() if header.startswith(BEARER) else ""


def check_api_key(headers: Mapping[str, str], api_keys: tuple[str, ...]) -> str:
    """The request's key if it is one of ``api_keys`` (compared in constant time); raises Unauthorized."""
    token = bearer_token(headers)
    # compare against every key, so the time taken does not say which key a guess was close to
    matched = [hmac.compare_digest(token.encode(), key.encode()) for key in api_keys]
    if not token or not any(matched):
        raise Unauthorized("missing or wrong API key (send Authorization: Bearer KEY)")
    return token


def key_tenant(api_key: str) -> str:
    return "key:" + hashlib.blake2b(api_key.encode(), digest_size=16).hexdigest()


CACHE_SALT_SEPARATOR = "\0cache_salt="


def namespace_salt(tenant: str, cache_salt: str | None) -> str:
    """Namespace.tenant_salt of a request: its tenant identity, split by its cache_salt when it sends one."""
    return tenant if cache_salt is None else tenant + CACHE_SALT_SEPARATOR + cache_salt


VLLM_CACHE_SALT_PREFIX = "kvshare-"


def vllm_cache_salt(salt: str) -> str | None:
    """The cache_salt a vLLM replica gets for namespace salt ``salt`` (namespace_salt), None for "" (the shared
    namespace). vLLM refuses a cache_salt over 128 characters or holding '@', '/', '\\' or NUL, which tenant
    identities and namespace_salt hold, so it gets a digest: one to one as far as BLAKE2b-256 collides never."""
    if not salt:
        return None
    return VLLM_CACHE_SALT_PREFIX + hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=32).hexdigest()


def account_identity(api_key: str, header_value: str) -> str:
    """Whose pool quota a request's pages count against (see the table above); ``api_key`` is "" without keys."""
    return key_tenant(api_key) if api_key else header_value


ACCOUNT_KEY_ENV = "KVSHARE_ACCOUNT_KEY"  # the key of account_tag, shared by the router and the vLLM replicas
MIN_ACCOUNT_KEY_CHARS = 16


def check_account_key(key: str) -> str:
    """``key`` if it is long enough to sign accounts with; raises ValueError (one line) otherwise."""
    if len(key) < MIN_ACCOUNT_KEY_CHARS:
        raise ValueError(
            f"the account key must have at least {MIN_ACCOUNT_KEY_CHARS} characters, "
            f"got {len(key)} (e.g. head -c 32 /dev/urandom | base64 > FILE)"
        )
    return key


def read_account_key(file: str = "") -> str:
    """The key the router signs vLLM pool accounts with, from ``file``, else $KVSHARE_ACCOUNT_KEY; "" when neither
    is set. Raises ValueError (one line) for an unreadable or short key."""
    from kvshare.credentials import read_secret

    key = read_secret("account key", file, ACCOUNT_KEY_ENV)
    return check_account_key(key) if key else ""


def account_tag(key: str, account: str) -> str:
    """The router's proof that it named ``account``: HMAC-SHA256 under the shared account key, in hex."""
    return hmac.new(key.encode(), b"kvshare-account\0" + account.encode(), hashlib.sha256).hexdigest()


def is_account_tag_valid(key: str, account: str, tag: str) -> bool:
    """Whether ``tag`` is ``account_tag(key, account)`` (compared in constant time); False without a key."""
    return bool(key) and hmac.compare_digest(account_tag(key, account).encode(), tag.encode())


def tenant_identity(api_key: str, header_value: str) -> str:
    """The salt of a request's pool namespace (see the table above); ``api_key`` is "" without keys."""
    if api_key:
        return key_tenant(api_key) + ("/" + header_value if header_value else "")
    return header_value
