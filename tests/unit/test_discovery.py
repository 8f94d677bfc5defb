"""tandem.router.discovery: the --workers grammar, and DNS re-resolution with a fake resolver."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from tandem.router.discovery import (
    Change,
    Discovery,
    WorkerTarget,
    getaddrinfo_resolver,
    parse_workers,
)
from tests.waits import until


class FakeDNS:
    """A resolver whose answers the test sets: a list of IPs, an exception, or a hang."""

    def __init__(self) -> None:
        self.records: dict[str, list[str] | BaseException | None] = {}
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.calls.append((name, port))
        answer = self.records.get(name, socket.gaierror(socket.EAI_NONAME, "no such name"))
        if answer is None:  # hang until the deadline cancels us
            await asyncio.Event().wait()
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, list)
        return list(answer)


# --- parsing -------------------------------------------------------------------------------------

def test_parse_all_forms() -> None:
    got = parse_workers("tcp://10.0.0.1:7100, 10.0.0.2:7101,dns://tandem-decode:7100,"
                        "tcp://[::1]:7102,DNS://tandem-prefill.ns.svc.cluster.local:7100")
    assert got == [
        WorkerTarget("tcp", "10.0.0.1", 7100),
        WorkerTarget("tcp", "10.0.0.2", 7101),
        WorkerTarget("dns", "tandem-decode", 7100),
        WorkerTarget("tcp", "::1", 7102),
        WorkerTarget("dns", "tandem-prefill.ns.svc.cluster.local", 7100),
    ]
    assert str(got[2]) == "dns://tandem-decode:7100"
    assert str(got[3]) == "tcp://[::1]:7102"


def test_parse_dedups_and_accepts_lists() -> None:
    got = parse_workers(["tcp://h:1,h:1", "dns://n:2", "dns://n:2,"])
    assert got == [WorkerTarget("tcp", "h", 1), WorkerTarget("dns", "n", 2)]


@pytest.mark.parametrize("bad, why", [
    ("", "no worker"),
    (" , ", "no worker"),
    ("http://h:1", "unknown scheme"),
    ("tcp://h", "HOST:PORT"),
    ("tcp://:7100", "HOST:PORT"),
    ("h:0", "1-65535"),
    ("h:65536", "1-65535"),
    ("h:port", "1-65535"),
    ("::1:7100", "brackets"),
    ("dns://[::1]:7100", "takes a name"),
    ("tcp://[::1]7100", "IPV6"),
])
def test_parse_rejects(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_workers(bad)


# --- discovery -----------------------------------------------------------------------------------

async def test_static_only_needs_no_loop() -> None:
    dns = FakeDNS()
    d = Discovery("tcp://127.0.0.1:7100,127.0.0.2:7100", resolver=dns)
    first = await d.start()
    assert first == Change(("tcp://127.0.0.1:7100", "tcp://127.0.0.2:7100"), ())
    assert not d.dynamic and not d.polling and dns.calls == []
    await d.close()


async def test_records_appear_and_disappear() -> None:
    dns = FakeDNS()
    dns.records["decode"] = ["127.0.0.2", "127.0.0.1"]
    seen: list[Change] = []
    d = Discovery("dns://decode:7100,tcp://127.0.0.9:7000", resolver=dns, on_change=seen.append)
    first = await d.start()
    assert first.added == ("tcp://127.0.0.1:7100", "tcp://127.0.0.2:7100", "tcp://127.0.0.9:7000")
    assert first.removed == ()
    assert d.addresses == first.added

    dns.records["decode"] = ["127.0.0.2", "127.0.0.3"]
    change = await d.refresh()
    assert change == Change(("tcp://127.0.0.3:7100",), ("tcp://127.0.0.1:7100",))
    assert d.addresses == ("tcp://127.0.0.2:7100", "tcp://127.0.0.3:7100", "tcp://127.0.0.9:7000")

    assert not await d.refresh()  # nothing changed: no callback
    dns.records["decode"] = []  # resolved to nothing: no decode workers, the static one stays
    change = await d.refresh()
    assert change.removed == ("tcp://127.0.0.2:7100", "tcp://127.0.0.3:7100") and not change.added
    assert d.addresses == ("tcp://127.0.0.9:7000",)
    assert seen == [first, Change(("tcp://127.0.0.3:7100",), ("tcp://127.0.0.1:7100",)), change]
    await d.close()


async def test_failures_keep_last_known_set_and_are_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    dns = FakeDNS()
    dns.records["prefill"] = ["127.0.0.1"]
    now = [100.0]
    seen: list[Change] = []
    d = Discovery("dns://prefill:7100", resolver=dns, on_change=seen.append,
                  log_every_s=30.0, clock=lambda: now[0], timeout_s=0.05)
    await d.start()
    target = d.targets[0]
    caplog.set_level(logging.INFO, logger="tandem.discovery")
    caplog.clear()
    for answer in (socket.gaierror(socket.EAI_AGAIN, "try again"), OSError("boom"), None,
                   ["not-an-ip"]):
        dns.records["prefill"] = answer
        assert not await d.refresh()  # error, error, deadline, garbage: all keep the last set
        assert d.addresses == ("tcp://127.0.0.1:7100",)
    assert d.failures(target) == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "try again" in warnings[0].getMessage()
    now[0] += 31.0
    dns.records["prefill"] = RuntimeError("still broken")
    await d.refresh()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "3 similar since" in warnings[1].getMessage()
    assert "timed out" not in warnings[1].getMessage()  # the latest reason is the one logged

    dns.records["prefill"] = ["127.0.0.2"]
    change = await d.refresh()
    assert change == Change(("tcp://127.0.0.2:7100",), ("tcp://127.0.0.1:7100",))
    assert d.failures(target) == 0
    assert any("works again" in r.getMessage() for r in caplog.records)
    await d.close()


async def test_first_resolution_failure_starts_empty() -> None:
    dns = FakeDNS()  # no records at all: NXDOMAIN
    d = Discovery("dns://decode:7100", resolver=dns)
    assert not await d.start()
    assert d.addresses == ()
    dns.records["decode"] = ["127.0.0.4"]
    assert (await d.refresh()).added == ("tcp://127.0.0.4:7100",)
    await d.close()


async def test_loop_re_resolves_and_close_cancels_it() -> None:
    dns = FakeDNS()
    dns.records["w"] = ["127.0.0.1"]
    changes: asyncio.Queue[Change] = asyncio.Queue()

    async def on_change(c: Change) -> None:
        await changes.put(c)

    d = Discovery("dns://w:7100", resolver=dns, on_change=on_change, interval_s=0.01)
    await d.start()
    assert (await changes.get()).added == ("tcp://127.0.0.1:7100",)
    dns.records["w"] = ["127.0.0.1", "127.0.0.5"]
    c = await asyncio.wait_for(changes.get(), 2.0)
    assert c == Change(("tcp://127.0.0.5:7100",), ())
    dns.records["w"] = OSError("resolver down")
    failing_from = len(dns.calls)
    await until(lambda: len(dns.calls) >= failing_from + 3)  # two whole failing rounds, and on
    assert d.polling  # the loop lives on
    assert d.addresses == ("tcp://127.0.0.1:7100", "tcp://127.0.0.5:7100")
    await d.close()
    assert not d.polling
    calls = len(dns.calls)
    await asyncio.sleep(0.05)
    assert len(dns.calls) == calls  # nothing resolves after close
    await d.close()  # idempotent
    with pytest.raises(RuntimeError):
        await d.start()


async def test_callback_errors_do_not_stop_discovery(caplog: pytest.LogCaptureFixture) -> None:
    dns = FakeDNS()
    dns.records["w"] = ["127.0.0.1"]

    def bad(_: Change) -> None:
        raise RuntimeError("pool exploded")

    async with Discovery("dns://w:7100", resolver=dns, on_change=bad) as d:
        dns.records["w"] = ["127.0.0.2"]
        change = await d.refresh()
        assert change.added == ("tcp://127.0.0.2:7100",)
        assert d.addresses == ("tcp://127.0.0.2:7100",)
    assert any("pool exploded" in (r.exc_text or "") or r.exc_info for r in caplog.records)


async def test_names_resolve_concurrently_each_with_its_deadline() -> None:
    dns = FakeDNS()
    dns.records["slow"] = None  # hangs
    dns.records["fast"] = ["127.0.0.7"]
    d = Discovery("dns://slow:1,dns://fast:2", resolver=dns, timeout_s=0.1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await d.start()
    # "slow" hangs for ever: only its own 0.1 s deadline can end start(), so any finite bound
    # shows that; 10 s is one no loaded machine crosses.
    assert loop.time() - t0 < 10
    assert d.addresses == ("tcp://127.0.0.7:2",)
    await d.close()


async def test_default_resolver_ipv4_loopback() -> None:
    assert await getaddrinfo_resolver("127.0.0.3", 7100) == ["127.0.0.3"]
    assert await getaddrinfo_resolver("localhost", 7100) == ["127.0.0.1"]


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Discovery("h:1", interval_s=0)
    with pytest.raises(ValueError, match="unknown scheme"):
        Discovery("udp://h:1")
