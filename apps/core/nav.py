"""The dashboard's navigation. Other apps add their pages here (see docs/frontend.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NavItem:
    label: str
    url_name: str  # a URL name, reversed with no arguments
    scope: str = "read"  # the session role's scope needed to see the entry
    section: str = ""  # the `nav_section` a page sets to highlight its entry


NAV_ITEMS: list[NavItem] = [
    NavItem("Sandboxes", "frontend:sandboxes", section="sandboxes"),
    NavItem("API keys", "frontend:keys", scope="admin", section="keys"),
    NavItem("Members", "frontend:members", section="members"),
    NavItem("Activity", "frontend:activity", scope="admin", section="activity"),
]


def register_nav(item: NavItem, *, before: str | None = None) -> None:
    """Adds an entry once (call from your AppConfig.ready()); ``before`` names a label."""
    if any(existing.url_name == item.url_name for existing in NAV_ITEMS):
        return
    labels = [existing.label for existing in NAV_ITEMS]
    NAV_ITEMS.insert(labels.index(before) if before in labels else len(NAV_ITEMS), item)
