"""The exception tree, in two halves.

- `TandemError`: what the frontend process raises about a request (a bad request, no worker, a
  worker lost, a gap in a stream). Each knows its HTTP status and OpenAI error type.
- `EngineError`: what a worker's engine raises about a request. Each knows only the wire's
  `ErrorKind` (`kind`), which the request's last delta carries to the frontend; there
  tandem.frontend.http's table, the only one, turns a kind into an HTTP status and type.
"""

from __future__ import annotations

from tandem.runtime.wire import ErrorKind


class TandemError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        """OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class BadRequest(TandemError):
    status = 400
    type = "invalid_request_error"


class ModelNotFound(TandemError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(TandemError):
    status = 404
    type = "invalid_request_error"


class Unavailable(TandemError):
    """No worker can take the request (none up, or all at their limits past the queue deadline)."""

    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


class WorkerLost(TandemError):
    """The worker serving a request died or stopped answering."""

    status = 502
    type = "worker_lost"
    code = "worker_lost"


class StreamProtocolError(TandemError):
    """A delta arrived with a gap or an overlap: the request fails loudly rather than lose tokens."""

    status = 500
    type = "protocol_error"
    code = "delta_offset_mismatch"


# --- engine and KV errors ----------------------------------------------------------------------------
# Each knows the wire's ErrorKind (`kind`) a failed request's last delta carries: the worker reads
# `err.kind`, never an isinstance chain. KV errors are engine errors, so a KV failure crosses the
# engine boundary as it is (no re-wrapping); the prefill side (tandem.kv.bootstrap.prefill) turns a
# mover's own failure (any exception) into a KvHandoffError, once.


class EngineError(Exception):
    """The engine failed; the request cannot go on. `param`: the request field at fault."""

    kind: ErrorKind = ErrorKind.ENGINE

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineRequestError(EngineError):
    """The request itself is unacceptable (too long, bad params): the frontend's 400."""

    kind = ErrorKind.BAD_REQUEST


class EngineBusy(EngineError):
    """What the request needs is held by other requests now (the grammar compiler): 503, retry."""

    kind = ErrorKind.BUSY


class CheckpointError(EngineError):
    """A model directory cannot be loaded (missing or inconsistent files)."""


class PagePoolError(EngineError):
    """KV page accounting refused an operation, or found a page lost or counted twice."""


class KvHandoffError(EngineError):
    """The KV of a PD request did not arrive (or could not be sent): the request fails; its pages
    are (or will be, once no write can land in them) released."""

    kind = ErrorKind.KV_TRANSFER


class KvTransferError(KvHandoffError):
    """A KV page transfer failed; the target pages hold undefined bytes."""


class KvTransferTimeout(KvTransferError):
    """The transfer missed its deadline; its handle was released (or is retried, never reused)."""


class PeerGone(KvTransferError):
    """The peer agent disconnected: its process died or it closed its agent."""
