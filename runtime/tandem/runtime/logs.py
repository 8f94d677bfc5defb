"""Log setup for every tandem process: `--log-level` and `--log-format text|json`.

`text` is one human line per record: time, level, logger, pid, message. `json` is one JSON object
per line (`ts`, `level`, `logger`, `pid`, `msg`, plus every field a call site passed in
`extra={"fields": {...}}`, and `exc` for a traceback), for log shippers. Access lines
(tandem.frontend.access) pass their request's fields that way, so in JSON they are keys, not text
to parse.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"
_encode = msgspec.json.Encoder().encode


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "pid": record.process,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                out.setdefault(k, v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        try:
            return _encode(out).decode()
        except (TypeError, msgspec.EncodeError):
            return _encode({k: str(v) for k, v in out.items()}).decode()


def formatter(fmt: str = "text") -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt != "text":
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    return logging.Formatter(TEXT_FORMAT)


def setup(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once for this process: one stderr handler, the given format."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
