"""DRF's JSON parser through the shared checks of apps/core/inputs.py."""

from __future__ import annotations

from typing import Any

from rest_framework import parsers

from apps.core.inputs import json_loads


class JSONParser(parsers.JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        return json_loads(stream.read())
