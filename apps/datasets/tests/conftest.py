"""Shared fixtures: the dashboard's users (frontend) for page tests."""

from frontend.tests.conftest import assets, make_user

__all__ = ["assets", "make_user"]
