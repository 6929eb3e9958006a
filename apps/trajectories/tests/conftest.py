"""The dashboard's browser fixtures (built assets, users with roles), shared."""

from frontend.tests.conftest import assets, make_user

__all__ = ["assets", "make_user"]
