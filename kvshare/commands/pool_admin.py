"""Administer a running pool: flush chunks (all, one namespace, or one replica's tenant), list leases and namespaces."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.pool.client import PoolClient


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", "--pool", dest="socket", default=None, help="the pool's Unix socket")
    p.add_argument("--name", default=None, help="the pool of `kvshare up --name NAME` (its port when not named)")
    sub = p.add_subparsers(dest="action", required=True)
    flush = sub.add_parser("flush", help="drop committed chunks (all when no namespace is named)")
    which = flush.add_mutually_exclusive_group()
    which.add_argument("--namespace", default=None, help="hex namespace digest (see `namespaces`)")
    which.add_argument(
        "--replica",
        default=None,
        metavar="URL",
        help="the namespace a replica uses for --tenant (asked at URL/admin/namespace; a vLLM "
        "replica's connector names it for one request salted as the router salts the tenant's)",
    )
    flush.add_argument(
        "--tenant",
        default=None,
        help="with --replica: the tenant header's value (default: the replica's untenanted namespace)",
    )
    flush.add_argument(
        "--api-key", default=None, help="with --replica: the bearer token (with keys, it names the tenant)"
    )
    flush.add_argument("--yes", action="store_true", help="flush without asking (needed where stdin is no terminal)")
    sub.add_parser("leases", help="list leases with their ages")
    sub.add_parser("namespaces", help="list namespaces with their chunks and bytes (and the quota)")


def replica_namespace(url: str, tenant: str | None, api_key: str | None, timeout_s: float = 10.0) -> dict:
    """The namespace digest a replica uses for a tenant: a built-in replica's GET URL/admin/namespace, else (a
    server without that endpoint) what a vLLM replica's connector names for one request of the tenant."""
    import urllib.error
    import urllib.parse

    from kvshare.errors import UserError

    query = "?" + urllib.parse.urlencode({"tenant": tenant}) if tenant is not None else ""
    try:
        return _get_json(url, "/admin/namespace" + query, api_key, timeout_s)
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return vllm_replica_namespace(url, tenant, api_key, timeout_s)
        detail = err.read().decode(errors="replace")[:300]
        raise UserError(f"{url} refused the namespace query ({err.code}): {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UserError(f"cannot reach the replica at {url}: {exc}") from None


def vllm_replica_namespace(url: str, tenant: str | None, api_key: str | None, timeout_s: float = 10.0) -> dict:
    """The namespace a vLLM replica's connector keys a tenant's unsalted requests by: it names a request's
    namespace in kv_transfer_params["kvshare"]. Asked with one request of one prompt token and the pool off for
    it, carrying the cache_salt the router gives that tenant's requests (kvshare.router.accounts.replica_salt;
    with --api-key the key's identity, as the router derives it from the same key)."""
    import urllib.error

    from kvshare.errors import UserError
    from kvshare.router.accounts import PARAMS_KEY, replica_salt
    from kvshare.serve.tenancy import tenant_identity

    try:
        models = _get_json(url, "/v1/models", api_key, timeout_s).get("data") or []
        if not models:
            raise ValueError("it lists no model at /v1/models")
        model = models[0]["id"]
        salt = replica_salt("vllm", tenant_identity(api_key or "", tenant or ""), None)
        body = {
            "model": model,
            "prompt": [0],
            "max_tokens": 1,
            "kv_transfer_params": {PARAMS_KEY: {"use_pool": False}},
            **({"cache_salt": salt} if salt else {}),
        }
        reply = _get_json(url, "/v1/completions", api_key, timeout_s, body)
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300]
        raise UserError(
            f"{url} has no /admin/namespace (not a kvshare replica) and refused a vLLM completion "
            f"({err.code}): {detail}"
        ) from None
    except (urllib.error.URLError, OSError, ValueError, LookupError, TypeError) as exc:
        raise UserError(f"{url} has no /admin/namespace and answered no vLLM completion: {exc}") from None
    namespace = ((reply.get("kv_transfer_params") or {}).get(PARAMS_KEY) or {}).get("namespace")
    if not isinstance(namespace, str):
        raise UserError(
            f"{url} is neither a kvshare replica nor a vLLM replica with kvshare's connector "
            "(its completions name no kvshare namespace)"
        )
    return {"model": model, "namespace": namespace, "is_tenant_salted": bool(salt)}


def _get_json(url: str, path: str, api_key: str | None, timeout_s: float, body: dict | None = None):
    """GET (or with ``body``, POST) URL/path; the JSON it answers. Raises urllib's errors."""
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = None
    if body is not None:
        data, headers = json.dumps(body).encode(), {**headers, "Content-Type": "application/json"}
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _confirm(action: str, is_confirmed: bool) -> None:
    """Ask before a destructive action (naming the pool it hits) unless --yes; no terminal: refuse."""
    import sys

    from kvshare.errors import UserError

    if is_confirmed:
        return
    if not sys.stdin.isatty():
        raise UserError(f"will not {action} without asking: add --yes")
    answer = input(f"{action}? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise UserError("nothing flushed")


def _namespace(text: str) -> bytes:
    from kvshare.errors import UserError

    try:
        return bytes.fromhex(text)
    except ValueError:
        raise UserError(
            f"--namespace {text!r} is not a hex digest; `kvshare pool-admin namespaces` lists them"
        ) from None


def run(args: argparse.Namespace) -> int:
    from kvshare.errors import UserError
    from kvshare.paths import find_pool_socket
    from kvshare.pool.client import PoolClient, PoolUnavailable

    if args.action == "flush" and args.replica is None and (args.tenant is not None or args.api_key is not None):
        raise UserError("--tenant and --api-key name a tenant through a replica: add --replica URL")
    try:
        namespace, named = None, {}
        if args.action == "flush" and args.replica:
            named = replica_namespace(args.replica, args.tenant, args.api_key)
            namespace = bytes.fromhex(named["namespace"])
        elif args.action == "flush" and args.namespace:
            namespace = _namespace(args.namespace)
        socket_path = args.socket or find_pool_socket(args.name)
        with PoolClient(socket_path, name="pool-admin") as client:
            if args.action == "flush":
                _flush(client, socket_path, namespace, named, args.yes)
            elif args.action == "leases":
                print(json.dumps(_leases(client), indent=2))
            else:
                print(json.dumps(_namespaces(client), indent=2))
    except (PoolUnavailable, ValueError) as exc:
        raise UserError(str(exc)) from None
    return 0


def _flush(client: PoolClient, socket_path: str, namespace: bytes | None, named: dict, yes: bool) -> None:
    """Flush one namespace the pool holds (or every chunk, after confirmation) and print what was dropped."""
    from kvshare.errors import UserError

    held = {n.namespace for n in client.list_namespaces().namespaces} if namespace is not None else set()
    if namespace is not None and namespace not in held:
        raise UserError(
            f"the pool at {socket_path} holds no namespace {namespace.hex()}; "
            f"`kvshare pool-admin namespaces` lists them"
        )
    _confirm(
        f"flush {'namespace ' + namespace.hex() if namespace else 'every chunk'} of the pool at {socket_path}",
        yes,
    )
    out = {"dropped": client.flush(namespace), "pool": socket_path}
    if namespace is not None:
        out["namespace"] = namespace.hex()
    if named:
        out["model"] = named["model"]
    print(json.dumps(out))


def _leases(client: PoolClient) -> list[dict]:
    """The pool's open leases: who holds how many pages, since when."""
    return [
        {
            "lease_id": l.lease_id,
            "client_id": l.client_id,
            "client": l.client_name,
            "pages": l.num_pages,
            "age_s": l.age_s,
        }
        for l in client.list_leases()
    ]


def _namespaces(client: PoolClient) -> dict:
    """The pool's namespaces and quota owners, with the entries and bytes each holds."""
    reply = client.list_namespaces()
    rows = [{"namespace": n.namespace.hex(), "entries": n.num_entries, "bytes": n.num_bytes} for n in reply.namespaces]
    owners = [{"owner": n.namespace.hex(), "entries": n.num_entries, "bytes": n.num_bytes} for n in reply.accounts]
    return {"quota_bytes": reply.quota_bytes, "namespaces": rows, "quota_owners": owners}
