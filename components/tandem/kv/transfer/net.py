"""Which network interface the KV transfer (NIXL over UCX) may use: the one that holds the
worker's advertised address (`--advertise-host`), so UCX does not listen on every interface.

NIXL 1.5.1's Python agent config has no interface setting (its UCX backend takes a
`device_list` parameter, and UCX reads `UCX_NET_DEVICES`); tandem sets `UCX_NET_DEVICES` in the
worker's environment before any agent exists (and before an engine starts subprocesses that
inherit it), unless the operator already set it. RDMA devices, which listen on no IP interface,
stay usable: they are listed too.

`net_device_for` is pure (interfaces and RDMA ports are arguments); `bind_ucx_to` applies it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

log = logging.getLogger("tandem.kv")

UNSPECIFIED = ("", "0.0.0.0", "::", "*")


def _ips_of(host: str) -> set[str]:
    """The IP addresses `host` names (a literal, or what the resolver says; none if it fails)."""
    try:
        return {str(ipaddress.ip_address(host.strip("[]")))}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {str(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in infos}


def net_device_for(host: str, interfaces: Mapping[str, Sequence[Any]],
                   rdma_ports: Iterable[str] = ()) -> str | None:
    """The UCX_NET_DEVICES value that keeps UCX on the interface holding `host`'s address, plus
    the RDMA ports given: `interfaces` is shaped like `psutil.net_if_addrs()` (name -> entries
    with `.family` and `.address`). None when `host` is unspecified or no interface holds it."""
    if host in UNSPECIFIED:
        return None
    ips = _ips_of(host)
    for name, addrs in sorted(interfaces.items()):
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = str(ipaddress.ip_address(str(a.address).split("%")[0]))
            except ValueError:
                continue
            if ip in ips:
                return ",".join([name, *sorted(rdma_ports)])
    return None


def rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
    """This machine's RDMA ports as UCX names them ("mlx5_0:1")."""
    try:
        devices = os.listdir(root)
    except OSError:
        return []
    out = []
    for dev in devices:
        try:
            out += [f"{dev}:{p}" for p in os.listdir(os.path.join(root, dev, "ports"))]
        except OSError:
            continue
    return out


def bind_ucx_to(host: str, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set UCX_NET_DEVICES in `env` for `host` (see the module docstring); return what UCX will
    use (None: UCX's own choice)."""
    if env.get("UCX_NET_DEVICES"):
        return env["UCX_NET_DEVICES"]
    import psutil

    devices = net_device_for(host, psutil.net_if_addrs(), rdma_ports())
    if devices is None:
        if host not in UNSPECIFIED:
            log.warning("no network interface holds %s: UCX (KV transfers) may use every "
                        "interface; set UCX_NET_DEVICES", host)
        return None
    env["UCX_NET_DEVICES"] = devices
    log.info("KV transfers (UCX) bound to %s, the interface of %s", devices, host)
    return devices
