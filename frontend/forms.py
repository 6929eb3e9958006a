"""Turns the dashboard's create form into the API's request body, so both validate alike."""

from __future__ import annotations

from typing import Any

from django.http import QueryDict

from apps.sandboxes.api.serializers import SandboxCreateSerializer


def parse_labels(text: str) -> tuple[dict[str, str], str | None]:
    """``key=value`` per line (or comma-separated) → dict, or an error message."""
    labels: dict[str, str] = {}
    for raw in text.replace(",", "\n").splitlines():
        line = raw.strip()
        if not line:
            continue
        if "=" not in line:
            return {}, f"write labels as key=value (got {line!r})"
        key, value = line.split("=", 1)
        labels[key.strip()] = value.strip()
    return labels, None


def sandbox_form_errors(post: QueryDict) -> tuple[SandboxCreateSerializer, dict[str, str]]:
    """Validates the form with the API's own serializer; errors are keyed by form field."""
    data: dict[str, Any] = {
        "image": post.get("image") or "host",
        "network_access": post.get("network_access") == "on",
    }
    for name in ("cpu", "memory", "ttl_seconds", "sandbox_id"):
        value = (post.get(name) or "").strip()
        if value:
            data[name] = value
    errors: dict[str, str] = {}
    labels, label_error = parse_labels(post.get("labels") or "")
    if label_error:
        errors["labels"] = label_error
    elif labels:
        data["labels"] = labels
    serializer = SandboxCreateSerializer(data=data)
    if not serializer.is_valid():
        for field, messages in serializer.errors.items():
            first = messages[0] if isinstance(messages, list) and messages else messages
            errors.setdefault(str(field), str(first))
    return serializer, errors
