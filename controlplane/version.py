"""One version for the whole of Hedgerow: the server, its OpenAPI document and the
Python SDK (``sdk/hedgerow/_common.py`` and ``sdk/pyproject.toml`` carry the same
number; a test keeps them in step). docs/sdk.md states the compatibility policy.
Plain constants: settings.py imports this module."""

from __future__ import annotations

from typing import Any

VERSION = "0.3.0"
API_VERSION = "v1"
# The oldest SDK release this server supports (docs/sdk.md, "Versions and
# compatibility"): within API v1, fields and endpoints are only added, so every SDK
# from this release on keeps working until the API's major version changes.
SDK_MINIMUM = "0.2.0"


def version_info() -> dict[str, Any]:
    return {
        "version": VERSION,
        "api": API_VERSION,
        "sdk": {"minimum": SDK_MINIMUM, "current": VERSION},
    }
