"""Structured JSON logs carrying the request id through web, worker and agent."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


# A key in a URL (the Orchard PTY's ``?api_key=``, the one place a key may travel in
# one) and anything shaped like a Hedgerow key. The 8-character prefix stays: it is
# what the dashboard shows, and it names the key without revealing it.
_SECRET_PATTERNS = [
    (re.compile(r"(api_key=)[^&\s\"']+"), r"\1[redacted]"),
    (re.compile(r"\b(hr_[A-Za-z0-9_-]{8})[A-Za-z0-9_-]{8,}"), r"\1[redacted]"),
]


def redact(text: str) -> str:
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactSecretsFilter(logging.Filter):
    """Rewrites a record's message so no API key reaches a log. Servers log URLs we do
    not control the format of: uvicorn logs every websocket handshake's path with its
    query string (``"WebSocket /orchard/…/exec/pty?api_key=…" [accepted]``) on
    ``uvicorn.error``, even with the access log off."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        return True


# The ASGI servers' own loggers: they have their own handlers (configured before the
# application is imported), so the filter goes on the loggers that emit the records.
SERVER_LOGGERS = (
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "daphne",
    "daphne.server",
    "django.channels.server",  # runserver under daphne (HEDGEROW_USE_DAPHNE)
)


def redact_server_logs() -> None:
    """Installs ``RedactSecretsFilter`` on the ASGI servers' loggers (idempotent)."""
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecretsFilter) for f in logger.filters):
            logger.addFilter(RedactSecretsFilter())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "") or request_id_var.get()
        if request_id:
            payload["request_id"] = request_id
        for key in (
            "sandbox_id",
            "operation_id",
            "tenant_id",
            "event",
            "method",
            "path",
            "status",
            "duration_ms",
        ):
            value = getattr(record, key, None)
            if value is not None:
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        # Last line of defence: a key quoted in a message or a traceback never lands.
        return redact(json.dumps(payload, default=str))
