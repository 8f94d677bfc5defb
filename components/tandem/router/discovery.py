"""Worker discovery for the frontend: what `--workers` says, and which addresses that is right now.

This module owns two things:

- `parse_workers`: the `--workers` grammar. A comma-separated list of `tcp://HOST:PORT` (or the bare
  `HOST:PORT`), static addresses used as given, and `dns://NAME:PORT`, a DNS name whose IPv4 A
  records are the workers (a Kubernetes headless Service has one record per *ready* pod).
- `Discovery`: the current set of `tcp://IP:PORT` addresses those entries stand for. It resolves
  every DNS name once on `start()`, then again every `interval_s` seconds in a task it owns
  (`close()` cancels and awaits it); each resolution has a deadline (`timeout_s`). Every change is
  reported as a `Change` (added, removed) to an `on_change` callback that a worker pool consumes:
  connect the added addresses, drop the removed ones once their requests end.

The resolver is injectable (`resolver=`). One test seam reaches it from outside the process: when
the environment variable `TANDEM_DISCOVERY_HOSTS` names a file, the default resolver reads that file
(hosts format: `IP NAME [NAME...]` per line, `#` comments) on every resolution instead of asking
DNS, so end-to-end tests can make a name resolve to several loopback addresses and change the set
while a frontend runs. Production leaves it unset.

The loop task is supervised: if it ever dies of an error (resolution and callback errors are
handled inside it), the process goes down (tandem.runtime.lifecycle.crash) rather than serving on a
frozen worker set.

DNS only says which addresses exist; whether a worker is alive stays the business of the ZMQ
heartbeats. A name that fails to resolve (error, deadline, NXDOMAIN) keeps its last known set: a
flaky resolver must not tear down healthy connections. Failures are logged, rate-limited per name,
and never end the loop. A name that resolves to no records successfully means "no workers there".
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tandem.runtime import lifecycle
from tandem.runtime.transport import url_host

log = logging.getLogger("tandem.discovery")

DEFAULT_INTERVAL_S = 3.0  # re-resolve DNS names this often
DEFAULT_TIMEOUT_S = 2.0  # one resolution may take this long before it counts as failed
DEFAULT_LOG_EVERY_S = 30.0  # at most one failure line per name this often
HOSTS_ENV = "TANDEM_DISCOVERY_HOSTS"  # test seam: resolve names from this hosts-format file

Resolver = Callable[[str, int], Awaitable[Iterable[str]]]
"""`resolver(name, port)` -> the IPv4 addresses `name` stands for now (raises on failure)."""

OnChange = Callable[["Change"], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class WorkerTarget:
    """One `--workers` entry: `scheme` is "tcp" (a fixed address) or "dns" (a name to resolve)."""

    scheme: str
    host: str
    port: int

    @property
    def is_dns(self) -> bool:
        return self.scheme == "dns"

    def __str__(self) -> str:
        return f"{self.scheme}://{_join(self.host, self.port)}"


@dataclass(frozen=True, slots=True)
class Change:
    """What one refresh changed: addresses to connect and addresses to drop (both sorted)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def _join(host: str, port: int) -> str:
    return f"{url_host(host)}:{port}"


def tcp_address(host: str, port: int) -> str:
    """The ZMQ address of a worker: `tcp://HOST:PORT` (IPv6 hosts in brackets)."""
    return f"tcp://{_join(host, port)}"


def _parse_one(entry: str) -> WorkerTarget:
    scheme, sep, rest = entry.partition("://")
    if not sep:
        scheme, rest = "tcp", entry
    scheme = scheme.lower()
    if scheme not in ("tcp", "dns"):
        raise ValueError(f"worker address {entry!r}: unknown scheme {scheme!r} "
                         "(use tcp://HOST:PORT, HOST:PORT or dns://NAME:PORT)")
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or not tail.startswith(":"):
            raise ValueError(f"worker address {entry!r}: expected [IPV6]:PORT")
        port_text = tail[1:]
        if scheme == "dns":
            raise ValueError(f"worker address {entry!r}: dns:// takes a name, not an address")
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon or not host:
            raise ValueError(f"worker address {entry!r}: expected HOST:PORT")
        if ":" in host:
            raise ValueError(f"worker address {entry!r}: put an IPv6 address in brackets")
    if not host or "/" in host or any(c.isspace() for c in host):
        raise ValueError(f"worker address {entry!r}: bad host {host!r}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"worker address {entry!r}: port must be 1-65535, got {port_text!r}")
    return WorkerTarget(scheme, host, int(port_text))


def parse_workers(spec: str | Iterable[str]) -> list[WorkerTarget]:
    """Parse `--workers` (one comma-separated string, or several of them); duplicates dropped,
    order kept. Raises ValueError with the offending entry on any malformed one, or on none."""
    parts = [spec] if isinstance(spec, str) else list(spec)
    out: list[WorkerTarget] = []
    for part in parts:
        for raw in part.split(","):
            entry = raw.strip()
            if not entry:
                continue
            target = _parse_one(entry)
            if target not in out:
                out.append(target)
    if not out:
        raise ValueError("no worker addresses given")
    return out


async def getaddrinfo_resolver(name: str, port: int) -> list[str]:
    """The default resolver: the IPv4 (A record) addresses of `name`, via the loop's getaddrinfo."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def hosts_file_resolver(path: str | os.PathLike[str]) -> Resolver:
    """A resolver reading a hosts-format file (`IP NAME [NAME...]`) at every call: the IPv4
    addresses listed for `name`; a name the file does not list fails like NXDOMAIN."""
    file = Path(path)

    async def resolve(name: str, port: int) -> list[str]:
        found: set[str] = set()
        listed = False
        for line in file.read_text().splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) < 2 or name not in fields[1:]:
                continue
            listed = True
            try:
                found.add(_ipv4(fields[0]))
            except ValueError:
                continue  # an IPv6 or malformed entry: not an A record
        if not listed:
            raise socket.gaierror(socket.EAI_NONAME, f"{name} is not in {file}")
        return sorted(found)

    return resolve


def default_resolver() -> Resolver:
    """DNS (getaddrinfo), or the hosts file `TANDEM_DISCOVERY_HOSTS` names (a test seam)."""
    path = os.environ.get(HOSTS_ENV)
    return hosts_file_resolver(path) if path else getaddrinfo_resolver


def _ipv4(text: str) -> str:
    return str(ipaddress.IPv4Address(text))  # raises ValueError on anything else


class _NameState:
    __slots__ = ("addresses", "failures", "last_logged", "suppressed")

    def __init__(self) -> None:
        self.addresses: frozenset[str] = frozenset()
        self.failures = 0  # consecutive failed resolutions
        self.last_logged = float("-inf")
        self.suppressed = 0


class Discovery:
    """The current worker addresses of a `--workers` list; see the module docstring."""

    def __init__(self, targets: str | Iterable[str] | Iterable[WorkerTarget], *,
                 resolver: Resolver | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, on_change: OnChange | None = None,
                 log_every_s: float = DEFAULT_LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be positive")
        items = [targets] if isinstance(targets, str) else list(targets)
        if items and all(isinstance(t, WorkerTarget) for t in items):
            self.targets: tuple[WorkerTarget, ...] = tuple(
                t for t in items if isinstance(t, WorkerTarget))
        else:
            self.targets = tuple(parse_workers([str(t) for t in items]))
        self._resolve: Resolver = resolver or default_resolver()
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_change = on_change
        self.log_every_s = log_every_s
        self._clock = clock
        self._static = frozenset(tcp_address(t.host, t.port) for t in self.targets if not t.is_dns)
        self._names = {t: _NameState() for t in self.targets if t.is_dns}
        self._current: frozenset[str] = frozenset()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.refreshes = 0  # completed refresh rounds (for tests and /metrics)

    @property
    def addresses(self) -> tuple[str, ...]:
        """The current set of `tcp://IP:PORT` addresses, sorted."""
        return tuple(sorted(self._current))

    @property
    def dynamic(self) -> bool:
        """True when some entry is a DNS name (so the set can change after start)."""
        return bool(self._names)

    @property
    def polling(self) -> bool:
        """Whether DNS names are being re-resolved in the background (started, not closed)."""
        return self._task is not None and not self._task.done()

    def failures(self, target: WorkerTarget) -> int:
        """Consecutive failed resolutions of a DNS target (0 once it resolves again)."""
        return self._names[target].failures

    async def start(self) -> Change:
        """Resolve everything once (so the first set is known before anything connects), then
        keep re-resolving DNS names in the background. Returns the first Change (all added)."""
        if self._closed:
            raise RuntimeError("Discovery is closed")
        if self._task is not None:
            raise RuntimeError("Discovery already started")
        first = await self.refresh()
        if self._names and not self._closed:
            self._task = asyncio.create_task(self._loop(), name="tandem-discovery")
            self._task.add_done_callback(_supervise)
        return first

    async def close(self) -> None:
        """Stop re-resolving: cancels the loop task and waits for it to end. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():  # it was us who got cancelled, not the task
                    raise

    async def __aenter__(self) -> Discovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _loop(self) -> None:  # (supervised: see _supervise)
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # refresh handles resolver errors; this is a bug, keep going
                log.exception("discovery refresh failed")

    async def refresh(self) -> Change:
        """One round: resolve every DNS name at once (each within `timeout_s`), update the set,
        and report the difference to `on_change` when there is one."""
        targets = list(self._names)
        results = await asyncio.gather(*(self._resolve_one(t) for t in targets))
        new = set(self._static)
        for target, got in zip(targets, results, strict=True):
            state = self._names[target]
            if got is not None:
                state.addresses = got
            new.update(state.addresses)
        now = frozenset(new)
        change = Change(tuple(sorted(now - self._current)), tuple(sorted(self._current - now)))
        self._current = now
        self.refreshes += 1
        if change:
            log.info("workers changed: +%s -%s", list(change.added), list(change.removed))
            await self._notify(change)
        return change

    async def _resolve_one(self, target: WorkerTarget) -> frozenset[str] | None:
        state = self._names[target]
        try:
            raw = await asyncio.wait_for(self._resolve(target.host, target.port), self.timeout_s)
            got = frozenset(tcp_address(_ipv4(ip), target.port) for ip in raw)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any resolver failure keeps the last set
            state.failures += 1
            why = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            now = self._clock()
            if now - state.last_logged >= self.log_every_s:
                more = f" ({state.suppressed} similar since)" if state.suppressed else ""
                log.warning("resolving %s failed (%d in a row): %s; keeping %d known address(es)%s",
                            target, state.failures, why, len(state.addresses), more)
                state.last_logged = now
                state.suppressed = 0
            else:
                state.suppressed += 1
            return None
        if state.failures:
            log.info("resolving %s works again after %d failure(s)", target, state.failures)
            state.failures = 0
            state.suppressed = 0
            state.last_logged = float("-inf")
        return got

    async def _notify(self, change: Change) -> None:
        if self.on_change is None:
            return
        try:
            result = self.on_change(change)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery on_change callback failed for %s", change)


def _supervise(task: asyncio.Task[None]) -> None:
    """The loop must only end by cancellation; an error ending it is fatal to the process."""
    if not task.cancelled() and task.exception() is not None:
        lifecycle.crash("worker discovery stopped", task.exception())
