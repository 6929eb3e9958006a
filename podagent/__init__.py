"""Hedgerow pod agent: the in-sandbox HTTP agent (stdlib only, Python >= 3.8)."""

from __future__ import annotations

VERSION = "1"
