"""Registry passwords at rest: the control plane's Fernet helper (apps/core/crypto.py),
kept under this name for the images app's callers."""

from __future__ import annotations

from apps.core.crypto import CredentialKeyError, decrypt, encrypt

__all__ = ["CredentialKeyError", "decrypt", "encrypt"]
