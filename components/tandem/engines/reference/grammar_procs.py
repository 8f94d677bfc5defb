"""Grammar compiles that can be stopped: each slot of tandem.engines.grammars.Compiles has a
process of its own, which compiles a request's grammar first, as a probe that is killed at its
deadline; only a grammar the probe compiled within it is then compiled in the engine, on the
slot's thread (xgrammar has no way to stop a compile, and what it compiles is a mask cache of
tens of MB that would cost more to send from the process than to compile again: 1.9 s to
serialize and 0.45 s to read back an 11 KB schema's, compiled in 0.2 s,
perf/results/grammar_compile.md).

So a grammar that does not compile in time holds its slot for its deadline and no longer: its
process is killed, and a new one forked for the slot's next grammar; one that does, holds it for
about twice its compile time. The processes fork from a fork server that has imported xgrammar
(multiprocessing's "forkserver": the engine process has threads, which a plain fork would copy
into a broken state), so a new one is ready in tens of milliseconds; the fork server itself
starts on the first grammar (a few seconds: importing xgrammar imports torch), which counts
against no request's deadline (`STARTUP_S` bounds it). A process that dies fails its request as
an engine error and is replaced.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any

from tandem.runtime.errors import EngineError, EngineRequestError

__all__ = ["ProbeProcs", "STARTUP_S", "first_line"]

log = logging.getLogger("tandem.engine")

STARTUP_S = 60.0  # a compile process's start (the fork server's first: imports xgrammar)
_ctx: Any = None
_ctx_lock = threading.Lock()


def _context() -> Any:
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["xgrammar", __name__])
            _ctx = ctx
        return _ctx


def _serve(conn: Connection, tokenizer_json: str) -> None:
    """(In the compile process.) Compile what comes, answer ("ok", "") or ("bad", why)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_json)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, text, any_whitespace = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if kind == "json_schema":
                compiler.compile_json_schema(text, any_whitespace=any_whitespace,
                                             strict_mode=True)
            else:
                compiler.compile_regex(text)
            conn.send(("ok", ""))
        except (RuntimeError, ValueError, TypeError) as e:
            conn.send(("bad", first_line(e)))


class _Proc:
    """One slot's compile process (started when first needed, replaced when killed)."""

    def __init__(self, tokenizer_json: str) -> None:
        self.tokenizer_json = tokenizer_json
        self.proc: Any = None
        self.conn: Connection | None = None

    def ready(self) -> Connection:
        if self.proc is not None and self.proc.is_alive() and self.conn is not None:
            return self.conn
        self.kill()
        ctx = _context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.tokenizer_json), daemon=True,
                           name="tandem-grammar-compile")
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        if not parent.poll(STARTUP_S) or parent.recv()[0] != "ready":
            self.kill()
            raise EngineError(f"the grammar compile process did not start within "
                              f"{STARTUP_S:g}s")
        return parent

    def kill(self) -> None:
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.kill()
            proc.join(5)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


class ProbeProcs:
    """A compile process per slot (`slots` of them at most, each used by one thread at once)."""

    def __init__(self, tokenizer_json: str, slots: int) -> None:
        self._free = [_Proc(tokenizer_json) for _ in range(slots)]
        self._all = list(self._free)
        self._lock = threading.Lock()
        self._closed = False
        self.killed = 0  # probes killed at their deadline (tests, metrics)

    def probe(self, kind: str, text: str, any_whitespace: bool, deadline_s: float,
              param: str) -> None:
        """(On a slot's thread.) Return once `text` compiled in a process within `deadline_s`;
        EngineRequestError naming `param` when it does not compile, or not in time (the process
        is then killed); EngineError when the process failed."""
        with self._lock:
            if self._closed or not self._free:
                raise EngineError("the grammar compiler is shut down")
            p = self._free.pop()
        try:
            conn = p.ready()
            conn.send((kind, text, any_whitespace))
            if not conn.poll(deadline_s):
                p.kill()
                self.killed += 1
                raise EngineRequestError(f"{param} did not compile within {deadline_s:g}s; "
                                         "simplify it", param=param)
            status, why = conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            p.kill()
            raise EngineError(f"the grammar compile process failed: {e!r}") from None
        finally:
            with self._lock:
                self._free.append(p)
                if self._closed:
                    p.kill()
        if status == "bad":
            raise EngineRequestError(f"{param} cannot be used as a grammar: {why}", param=param)

    def pids(self) -> list[int]:
        return [p.pid for p in self._all if p.pid is not None]

    def close(self) -> None:
        """Kill every compile process (one a thread uses now goes when its thread lets go)."""
        with self._lock:
            self._closed = True
            free = list(self._free)
        for p in free:
            p.kill()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    # xgrammar's messages start with "[time] file:line: "; what follows is the reason.
    line = text.splitlines()[0] if text else type(e).__name__
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line

