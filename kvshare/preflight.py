"""Checks made before anything starts (``kvshare up``, ``pool``, ``serve``, ``route``).

Each failure is a UserError that names the flag to change:

- the model: a directory holding config.json, or a preset name;
- ports: free on the host (a bind test, so a second ``up`` on ports in use stops here, not after
  polling the first cluster's /health);
- the pool's size: at least MIN_POOL_BYTES, at most the memory this process may use (the arena is
  a memfd: anonymous shared memory, charged to this cgroup and not bounded by /dev/shm's size), and
  room for one page of the model;
- the pool socket's directory exists;
- built-in replicas and the pool fit the machine's memory and the GPUs' (kvshare.memory_fit).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
from collections.abc import Mapping

from kvshare.engine.preset_table import PRESETS
from kvshare.errors import UserError
from kvshare.layout import KVLayout
from kvshare.units import format_bytes

log = logging.getLogger(__name__)

# the presets' names (kvshare.engine.preset_table: the presets as data, read without torch)
PRESET_NAMES = tuple(PRESETS)
MIN_POOL_BYTES = 1 << 20  # smaller holds no page of any model worth serving (the tiny model's is 2 MiB)


# -- the model ----------------------------------------------------------------------------


def check_model(model: str, flag: str = "--model") -> None:
    """``model`` is a model directory (with config.json) or a preset name."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise UserError(
                f"{flag} {model}: the directory holds no config.json (a Hugging Face model directory "
                f"does; `kvshare make-model tiny --out DIR` writes one)"
            )
        return
    if model not in PRESETS:
        what = "no such directory" if os.sep in model or model.startswith(".") else "not a directory"
        raise UserError(f"{flag} {model}: {what}, and not a preset ({', '.join(PRESET_NAMES)})")


def model_layout(model: str, chunk_tokens: int) -> KVLayout:
    """The KV layout of ``model`` (a checked directory or preset) in its own dtype, read without loading weights."""
    if model in PRESETS and not os.path.isdir(model):
        config = PRESETS[model].config
    else:
        from kvshare.engine.config import model_config_from_hf

        with open(os.path.join(model, "config.json")) as f:
            config = model_config_from_hf(json.load(f))
    return KVLayout(config.num_kv_layers, config.num_kv_heads, config.head_dim, config.dtype, chunk_tokens)


# -- ports --------------------------------------------------------------------------------


def port_problem(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be listened on now (None: it can).

    With SO_REUSEADDR, as aiohttp binds: a port in TIME_WAIT is free, one with a listener is not.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((host, port), family=family):
            pass
    except OSError as exc:  # socket.gaierror too
        return exc
    return None


def check_ports_free(host: str, ports: Mapping[int, str], flag: str = "--port") -> None:
    """Every port in ``ports`` (port -> what would listen there) can be listened on at ``host``."""
    for port, what in ports.items():
        exc = port_problem(host, port)
        if exc is None:
            continue
        if exc.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} ({what}) on {host} is in use: another process listens there; "
                f"stop it or choose another {flag}"
            )
        raise UserError(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}")


# -- the pool -----------------------------------------------------------------------------


def memory_limit() -> tuple[int, str]:
    """(bytes, what they are): the memory this process may use, the smaller of MemTotal and its cgroup's limit."""
    limit, what = meminfo("MemTotal"), "this machine's memory (MemTotal)"
    cgroup = _cgroup_memory_max()
    if cgroup is not None and cgroup < limit:
        limit, what = cgroup, "this container's memory limit (cgroup memory.max)"
    return limit, what


def check_pool_size(size_bytes: int, flag: str = "--size") -> None:
    """Refuse a pool below MIN_POOL_BYTES or above the memory this process may use; warn above what is free."""
    if size_bytes < MIN_POOL_BYTES:
        raise UserError(
            f"{flag} {format_bytes(size_bytes)} is below the minimum of {format_bytes(MIN_POOL_BYTES)} "
            f"(one page of the tiny model is 2 MiB; `kvshare plan --model M --tokens N` sizes a pool)"
        )
    limit, what = memory_limit()
    if size_bytes > limit:
        raise UserError(
            f"{flag} {format_bytes(size_bytes)} is larger than {what}, {format_bytes(limit)}: "
            f"choose a smaller size (`kvshare plan --model M --tokens N` sizes a pool)"
        )
    from kvshare.pool.arena import hugepages_free_bytes

    available = meminfo("MemAvailable")
    if size_bytes > available and hugepages_free_bytes() < size_bytes:  # reserved hugepages are not "available"
        log.warning(
            "the pool's %s exceed the %s available now: its pages fill as KV is stored, and the machine "
            "may swap or kill processes once memory runs out",
            format_bytes(size_bytes),
            format_bytes(available),
        )


def check_pool_holds_a_page(
    pool_bytes: int, extent_bytes: int, layout: KVLayout, model: str, state_bytes: int = 0
) -> None:
    """A page of ``model`` fits in one extent of the pool (a page never straddles extents), and so does a hybrid
    model's state checkpoint (``state_bytes``; 0: none), a page of its own."""
    extent = min(extent_bytes, pool_bytes)
    which = "pool" if extent == pool_bytes else "pool's extent (--pool-arg --extent-size)"
    for what, size in (
        (f"one {layout.chunk_tokens}-token page", layout.page_bytes),
        ("a state checkpoint", state_bytes),
    ):
        if size > extent:
            raise UserError(
                f"{what} of {model} is {format_bytes(size)}, larger than the {which}, {format_bytes(extent)}: give a "
                f"larger --pool-size (`kvshare plan --model {model} --tokens N` sizes one), or --pool off"
            )


def model_state_bytes(model: str) -> int:
    """The bytes of a hybrid model's state checkpoint (kvshare.state_layout), read without loading weights; 0 for a
    model without GDN layers."""
    from kvshare.engine.hybrid_config import state_layout_of
    from kvshare.engine.preset_table import model_config_of

    config = model_config_of(model)
    return state_layout_of(config).checkpoint_bytes if config.is_hybrid else 0


def check_socket_dir(socket_path: str, flag: str = "--socket") -> None:
    """The directory a Unix socket is to be created in exists."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    if not os.path.isdir(directory):
        raise UserError(
            f"{flag} {socket_path}: the directory {directory} does not exist (create it, or choose another path)"
        )


def meminfo(field: str, path: str = "/proc/meminfo") -> int:
    """A field of /proc/meminfo in bytes (MemTotal, MemAvailable)."""
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name == field:
                return int(rest.split()[0]) * 1024
    raise RuntimeError(f"{path} has no {field}")


def _cgroup_memory_max() -> int | None:
    """This process's cgroup v2 memory.max (or v1 limit_in_bytes) in bytes; None when unlimited or unknown."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                hierarchy, _, path = line.strip().partition("::")
                if hierarchy == "0":
                    candidates.append(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.max"))
    except OSError:
        pass
    candidates += ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    for path in candidates:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes a huge number for "no limit"
            return int(text)
        if text == "max":
            return None
    return None
