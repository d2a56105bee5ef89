"""The account a replica charges a request's pool pages to: the authenticated identity, never its cache_salt."""

from __future__ import annotations

from kvshare.serve.tenancy import account_identity, key_tenant, namespace_salt, tenant_identity
from tests.serve.live import call, replica, tiny_engine


def test_account_is_the_key_alone_or_the_gateways_header():
    assert account_identity("key-a", "team-1") == account_identity("key-a", "team-2") == key_tenant("key-a")
    assert account_identity("", "acme") == "acme" and account_identity("", "") == ""
    assert "key-a" not in account_identity("key-a", "")  # the key itself never leaves the replica


def test_requests_with_any_salt_or_tenant_header_name_their_key_as_account():
    """Fails when the server leaves RequestOptions.account unset: the engine then charges each salt's namespace."""
    engine = tiny_engine()
    seen = []
    generate = engine.generate

    def recording(prompt_ids, params, options):
        seen.append(options)
        return generate(prompt_ids, params, options)

    engine.generate = recording
    with replica(engine, api_keys=("key-a",), tenant_header="X-Tenant") as url:
        for salt, team in (("s1", "red"), ("s2", "blue"), (None, "")):
            body = {"prompt": "hello", "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
            headers = {"Authorization": "Bearer key-a"} | ({"X-Tenant": team} if team else {})
            status, out = call(url, "/v1/completions", body, headers=headers)
            assert status == 200, out
    assert [o.tenant for o in seen] == [
        namespace_salt(tenant_identity("key-a", "red"), "s1"),
        namespace_salt(tenant_identity("key-a", "blue"), "s2"),
        tenant_identity("key-a", ""),
    ]
    assert [o.account for o in seen] == [key_tenant("key-a")] * 3
