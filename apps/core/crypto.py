"""Secrets at rest: Fernet (AES-128-CBC + HMAC-SHA256) with a key that is never in the
database: ``HEDGEROW_CREDENTIALS_KEY`` (a Fernet key), else ``<state dir>/credentials_key``
(mode 0600, written once by ``make up``/``make test`` or by the first process that needs
it). A database dump alone decrypts nothing.

Neutral ground for every app that stores an encrypted value (registry passwords in
``apps.images``, redacted trajectory secrets in ``apps.trajectories``), so neither
imports the other."""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

KEY_FILE = "credentials_key"


class CredentialKeyError(RuntimeError):
    """The key is missing, malformed, or not the one the value was encrypted with."""


def _key_file() -> Path:
    return Path(settings.STATE_DIR) / KEY_FILE


def _load_or_create_key() -> bytes:
    from_env = os.environ.get("HEDGEROW_CREDENTIALS_KEY", "")
    if from_env:
        return from_env.encode()
    path = _key_file()
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process won the race: use its key
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as fh:
        fh.write(Fernet.generate_key())
        fh.flush()
        os.fsync(fh.fileno())
    return path.read_bytes().strip()


@functools.cache
def _fernet() -> Fernet:
    key = _load_or_create_key()
    try:
        return Fernet(key)
    except ValueError as exc:
        raise CredentialKeyError(
            "HEDGEROW_CREDENTIALS_KEY / credentials_key is not a Fernet key"
        ) from exc


def encrypt(plaintext: str) -> str:
    return _fernet().encrypt(plaintext.encode()).decode()


def decrypt(token: str, *, what: str = "a stored secret") -> str:
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise CredentialKeyError(
            f"{what} cannot be decrypted with this installation's key"
        ) from exc


def fingerprint(scope: str, value: str) -> str:
    """A keyed digest of ``value`` within ``scope`` (HMAC-SHA256 with a key derived from
    the Fernet key): equal values in one scope match without decrypting anything, and
    the digest alone cannot be checked against a guess without the key."""
    return hmac.new(_fingerprint_key(), f"{scope}\x00{value}".encode(), hashlib.sha256).hexdigest()


@functools.cache
def _fingerprint_key() -> bytes:
    return hashlib.sha256(b"hedgerow-fingerprint:" + _load_or_create_key()).digest()
