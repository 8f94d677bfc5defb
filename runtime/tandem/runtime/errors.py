"""One flat exception hierarchy; each error knows the HTTP status and OpenAI error type it maps to."""

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


class EngineFailed(TandemError):
    status = 500
    type = "engine_error"


class StreamProtocolError(TandemError):
    """A delta arrived with a gap or an overlap: the request fails loudly rather than lose tokens."""

    status = 500
    type = "protocol_error"
    code = "delta_offset_mismatch"


# --- engine and KV errors ----------------------------------------------------------------------------
# Each knows the wire's ErrorKind (`kind`) a failed request's last delta carries: the worker reads
# `err.kind`, never an isinstance chain. KV errors are engine errors, so a KV failure crosses the
# engine boundary as it is (no re-wrapping); only tandem.kv.handoff turns a mover's own failure
# (any exception) into a KvHandoffError, once.


class EngineError(TandemError):
    """The engine failed; the request cannot go on."""

    status = 500
    type = "engine_error"
    kind: ErrorKind = ErrorKind.ENGINE


class EngineRequestError(EngineError):
    """The request itself is unacceptable (too long, bad params). Maps to HTTP 400."""

    status = 400
    type = "invalid_request_error"
    kind = ErrorKind.BAD_REQUEST


class CheckpointError(EngineError):
    """A model directory cannot be loaded (missing or inconsistent files)."""


class PagePoolError(EngineError):
    """KV page accounting refused an operation, or found a page lost or counted twice."""


class KvHandoffError(EngineError):
    """The KV of a PD request did not arrive (or could not be sent): the request fails; its pages
    are (or will be, once no write can land in them) released."""

    type = "kv_transfer_error"
    kind = ErrorKind.KV_TRANSFER


class KvTransferError(KvHandoffError):
    """A KV page transfer failed; the target pages hold undefined bytes."""


class KvTransferTimeout(KvTransferError):
    """The transfer missed its deadline; its handle was released (or is retried, never reused)."""


class PeerGone(KvTransferError):
    """The peer agent disconnected: its process died or it closed its agent."""
