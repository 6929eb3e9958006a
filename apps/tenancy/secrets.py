"""What an API key's secret looks like and how it is stored: ``hr_`` + 43 random
URL-safe characters, kept only as a SHA-256 hex digest. Its own module so that both
the writer (``services``) and the reader (``auth``) depend on it, not on each other."""

from __future__ import annotations

import hashlib

KEY_PREFIX = "hr_"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
