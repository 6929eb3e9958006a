"""The base environment commands run with.

Commands see the image's own environment plus the request's env, never the
agent's bookkeeping: every HEDGEROW_* variable is removed, and variables the
launcher had to change to run the agent on a bundled interpreter are restored
from HEDGEROW_AGENT_ENV_RESTORE (a JSON object; null means unset).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Mapping, Optional

RESTORE_VAR = "HEDGEROW_AGENT_ENV_RESTORE"
TOKEN_VAR = "HEDGEROW_AGENT_TOKEN"
PREFIX = "HEDGEROW_"


class EnvError(ValueError):
    pass


def build_base_env(source: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in source.items() if not k.startswith(PREFIX)}
    raw = source.get(RESTORE_VAR)
    if raw:
        try:
            restore = json.loads(raw)
        except ValueError as exc:
            raise EnvError(f"{RESTORE_VAR} is not valid JSON: {exc}") from exc
        if not isinstance(restore, dict):
            raise EnvError(f"{RESTORE_VAR} must be a JSON object")
        for key, value in restore.items():
            if value is None:
                env.pop(key, None)
            elif isinstance(value, str):
                env[key] = value
            else:
                raise EnvError(f"{RESTORE_VAR}[{key!r}] must be a string or null")
    return env


def scrub_own_environ() -> None:
    """Drop our bookkeeping from os.environ too, so nothing spawned without an
    explicit env (and no library reading os.environ) can see the token."""
    for key in [k for k in os.environ if k.startswith(PREFIX)]:
        del os.environ[key]


def find_shell(env: Mapping[str, str]) -> str:
    path = env.get("PATH") or os.defpath
    for name in ("bash", "sh"):
        found = shutil.which(name, path=path)
        if found:
            return found
    return "/bin/sh"


def has_bash(shell: str) -> bool:
    return os.path.basename(shell) == "bash"


def merged(base: Mapping[str, str], extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
    env = dict(base)
    if extra:
        env.update(extra)
    return env
