"""A command's environment values at rest (docs/security.md "Secrets").

A command's env often carries secrets (API tokens a task needs). An Operation row's
``request`` keeps the names with ``ENV_REDACTED`` for values, and the values only as one
Fernet token under ``ENV_SEALED`` (apps/core/crypto.py: the key is not in the
database); ``request_hash`` takes them as keyed digests, so a database reader cannot
test guesses against it. ``operations.request_from_record`` gives the full request back
(a streamed exec's pump, resumed by another process, re-sends it to the agent, whose
own fingerprint includes the values). No Django models here: episodes import it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from apps.core import crypto

ENV_REDACTED = "[redacted]"
ENV_SEALED = "env_sealed"


def request_fingerprint(data: dict[str, Any]) -> str:
    """The replay fingerprint of a request's fields (``output_window`` excluded by the
    caller): env values enter as keyed digests, never as themselves."""
    env = data.get("env")
    if env:
        data = {**data, "env": {k: crypto.fingerprint("exec-env", v) for k, v in env.items()}}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def request_record_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The stored form of a request's fields: env values replaced by ENV_REDACTED and
    sealed (encrypted) together under ENV_SEALED."""
    env = data.get("env")
    if not env:
        return data
    return {
        **data,
        "env": dict.fromkeys(env, ENV_REDACTED),
        ENV_SEALED: crypto.encrypt(json.dumps(env)),
    }


def sealed_env(stored: dict[str, Any] | None) -> dict[str, str]:
    """The env values a stored request sealed ({} when none)."""
    sealed = (stored or {}).get(ENV_SEALED)
    if not isinstance(sealed, str) or not sealed:
        return {}
    env: dict[str, str] = json.loads(crypto.decrypt(sealed))
    return env


def request_public(stored: dict[str, Any] | None) -> dict[str, Any] | None:
    """A recorded request as it may be shown or copied (episode steps, exports): the
    sealed values dropped, the names kept with ENV_REDACTED."""
    if stored is None or ENV_SEALED not in stored:
        return stored
    return {k: v for k, v in stored.items() if k != ENV_SEALED}
