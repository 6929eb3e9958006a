"""Registry passwords at rest: Fernet with a key outside the database. The key handling
lives in ``apps/core/crypto.py`` (shared with the trajectories' redacted secrets);
this module keeps the images app's names and messages."""

from __future__ import annotations

from apps.core import crypto as _crypto
from apps.core.crypto import KEY_FILE, CredentialKeyError

__all__ = ["KEY_FILE", "CredentialKeyError", "decrypt", "encrypt"]


def encrypt(plaintext: str) -> str:
    return _crypto.encrypt(plaintext)


def decrypt(token: str) -> str:
    return _crypto.decrypt(token, what="a stored registry password")
