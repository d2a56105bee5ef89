"""The isolation level: two tenants send the same prompt, and nothing of one shows to the other.

It starts its own cluster (kvshare.launch: a pool, replicas with ``--tenant-header``
and ``--provenance own-tenant``, a ``cache_aware`` router, the way a shared deployment
runs) and sends, through the router::

    tenant a   P, P again      the repeat reuses a's KV: the positive control (the checks can see sharing)
    tenant b   P               reuses nothing (no shared pages) and carries no replica header (no routing signal)
    no tenant  Q, Q again      one namespace for everyone: the repeat shows no provenance (no prompt oracle)

and asks a replica for the two tenants' namespace digests, which must differ. The
checks are pure functions of those answers (``isolation_rows``).
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from dataclasses import dataclass

from kvshare.validate.report import FAIL, PASS, LevelResult, Row, verdict_of

TENANT_HEADER = "X-Tenant-ID"
REPLICA_HEADER = "X-KVShare-Replica"


@dataclass(frozen=True)
class Answer:
    """One completion as the level reads it: its JSON body and its response headers."""

    body: dict
    headers: dict


def reused_tokens(answer: Answer) -> int | None:
    """Prompt tokens the answer says were reused (local + pool); None when it shows no provenance."""
    kv = answer.body.get("kvshare") or {}
    if "local_tokens" not in kv and "pool_tokens" not in kv:
        return None
    return int(kv.get("local_tokens", 0)) + int(kv.get("pool_tokens", 0))


def isolation_rows(
    owner_repeat: Answer, other: Answer, shared_repeat: Answer, namespaces: tuple[str, str]
) -> list[Row]:
    """The level's verdicts from what the tenants were answered (see the module docstring)."""
    owner = reused_tokens(owner_repeat)
    rows = [
        Row(
            "control: a tenant's own repeat reuses its KV",
            PASS if owner else FAIL,
            "" if owner else "the owner's repeat reused nothing: sharing could not be seen, so nothing is proven",
            {"reused_tokens": owner},
        )
    ]
    reused = reused_tokens(other)
    rows.append(
        Row(
            "no shared pages: another tenant's same prompt reuses nothing",
            PASS if reused == 0 else FAIL,
            "" if reused == 0 else "tenant b was served tenant a's KV (or shows no provenance to judge by)",
            {"reused_tokens": reused},
        )
    )
    header = {k.lower(): v for k, v in other.headers.items()}.get(REPLICA_HEADER.lower())
    rows.append(
        Row(
            "no routing signal: no replica header",
            PASS if header is None else FAIL,
            "" if header is None else f"the router told tenant b where the prompt went: {header}",
        )
    )
    details = (shared_repeat.body.get("usage") or {}).get("prompt_tokens_details")
    leaked = reused_tokens(shared_repeat) is not None or details is not None
    rows.append(
        Row(
            "no provenance signal in a shared namespace",
            FAIL if leaked else PASS,
            "a request without a tenant learns whether its prompt was sent before" if leaked else "",
        )
    )
    rows.append(
        Row(
            "tenants have namespaces of their own",
            PASS if namespaces[0] != namespaces[1] else FAIL,
            "" if namespaces[0] != namespaces[1] else f"both tenants use namespace {namespaces[0]}",
        )
    )
    return rows


def run_isolation_level(
    model: str, device: str, pool_size: str, replica_args: tuple[str, ...] = (), timeout_s: float = 600.0
) -> LevelResult:
    from kvshare.launch import Cluster, ClusterConfig, free_port_block

    started = time.perf_counter()
    config = ClusterConfig(
        num_replicas=2,
        model=model,
        device=device,
        pool_size=pool_size,
        policy="cache_aware",
        port=free_port_block(3),
        replica_args=replica_args,
        tenant_header=TENANT_HEADER,
        provenance="own-tenant",
        ready_timeout_s=timeout_s,
    )
    cluster = Cluster(config).start()
    try:
        nonce = uuid.uuid4().hex
        prompt = f"{nonce} A confidential preamble that only its tenant may reuse or time. " * 40
        shared = f"{nonce} A prompt sent twice in the namespace every untenanted request shares. " * 40

        def send(text: str, tenant: str | None) -> Answer:
            return _complete(cluster.router_url, model, text, {TENANT_HEADER: tenant} if tenant else {}, timeout_s)

        send(prompt, "a")
        owner_repeat, other = send(prompt, "a"), send(prompt, "b")
        send(shared, None)
        shared_repeat = send(shared, None)
        namespaces = tuple(
            _get(f"{cluster.replica_urls[0]}/admin/namespace?tenant={t}", timeout_s)["namespace"] for t in ("a", "b")
        )
    finally:
        cluster.stop()
    rows = isolation_rows(owner_repeat, other, shared_repeat, namespaces)
    status = verdict_of(rows)
    summary = "tenants share nothing" if status == PASS else "; ".join(r.name for r in rows if r.status == FAIL)
    return LevelResult(
        "isolation", status, summary, rows, {"model": model, "device": device}, time.perf_counter() - started
    )


def _complete(url: str, model: str, prompt: str, headers: dict, timeout_s: float) -> Answer:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return Answer(json.loads(resp.read()), dict(resp.headers))


def _get(url: str, timeout_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())
