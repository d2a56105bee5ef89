"""Tenant identity and API-key checks (pure functions of headers and configuration)."""

import pytest

from kvshare.keys import Namespace, namespace_digest
from kvshare.launch import ClusterConfig
from kvshare.router.config import RouterConfig
from kvshare.serve.config import ServeConfig
from kvshare.serve.tenancy import Unauthorized, bearer_token, check_api_key, key_tenant, tenant_identity


def test_api_key_check_accepts_only_configured_bearer_tokens():
    keys = ("alpha-key", "beta-key")
    assert check_api_key({"Authorization": "Bearer beta-key"}, keys) == "beta-key"
    for headers in (
        {},
        {"Authorization": "beta-key"},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer beta"},
        {"Authorization": "Basic YmV0YS1rZXk="},
        {"Authorization": "Bearer beta-key-and-more"},
    ):
        with pytest.raises(Unauthorized):
            check_api_key(headers, keys)
    assert bearer_token({"Authorization": "Bearer  spaced "}) == "spaced"


def test_identity_from_key_cannot_be_overridden_by_a_header():
    a, b = tenant_identity("key-a", ""), tenant_identity("key-b", "")
    assert a != b and "key-a" not in a  # the key itself never becomes part of the salt
    # a holder of key B naming tenant A's header value still lands under B's key
    assert tenant_identity("key-b", a) != a and tenant_identity("key-b", a).startswith(key_tenant("key-b") + "/")
    assert tenant_identity("", "acme") == "acme" and tenant_identity("", "") == ""


def test_tenants_get_different_namespace_digests():
    base = Namespace("tiny", "f" * 32, "float32", 8, 2, 64)
    digests = {namespace_digest(base.with_tenant(t)) for t in ("", "acme", "globex", tenant_identity("k", ""))}
    assert len(digests) == 4


def test_configs_refuse_empty_or_padded_keys():
    for bad in ("", " key", "key "):
        with pytest.raises(ValueError):
            ServeConfig(api_keys=(bad,))
        with pytest.raises(ValueError):
            RouterConfig(replicas=("http://127.0.0.1:1",), api_keys=(bad,))
    with pytest.raises(ValueError):
        ServeConfig(write_timeout_s=0)
    assert ClusterConfig(engine="vllm", tenant_header="X-Tenant-ID").replica_host == "127.0.0.1"  # behind the router


def test_up_route_and_serve_take_keys_and_tenant_header_flags():
    from kvshare.cli import build_parser

    parser = build_parser()
    up = parser.parse_args(
        ["up", "--api-key", "k1", "--api-key", "k2", "--tenant-header", "X-Tenant-ID", "--router-arg=--write-timeout=5"]
    )
    assert up.api_key == ["k1", "k2"] and up.tenant_header == "X-Tenant-ID" and up.router_arg == ["--write-timeout=5"]
    route = parser.parse_args(["route", "--replica", "http://127.0.0.1:1", "--api-key", "k1", "--write-timeout", "3"])
    assert route.api_key == ["k1"] and route.write_timeout == 3.0
    serve = parser.parse_args(["serve", "--api-key", "k1", "--tenant-header", "X-T", "--write-timeout", "2"])
    assert serve.api_key == ["k1"] and serve.tenant_header == "X-T" and serve.write_timeout == 2.0
    pool = parser.parse_args(["pool", "--size", "64MiB", "--namespace-quota", "8MiB"])
    assert pool.namespace_quota == 8 << 20
