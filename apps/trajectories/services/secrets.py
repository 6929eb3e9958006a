"""The episode side of redaction: load what an episode already maps, redact, store new
secrets encrypted, count occurrences; the admin read (audited) and the scan report."""

from __future__ import annotations

import hashlib
from typing import Any

from django.db.models import Count, F, QuerySet, Sum

from apps.core import crypto
from apps.core.inputs import json_loads
from apps.tenancy.models import Tenant
from apps.trajectories.models import Episode, EpisodeSecret, SecretAccess
from apps.trajectories.redaction import Redactor


def episode_scope(episode: Episode) -> str:
    """The placeholder scope: 8 hex characters derived from the episode's row id."""
    return hashlib.sha256(f"hedgerow-episode:{episode.pk}".encode()).hexdigest()[:8]


class EpisodeSecrets:
    """A redaction session for one episode (hold the episode's row lock, or own a row
    nobody else sees yet). ``redact`` any number of values, then ``save``."""

    def __init__(self, episode: Episode, *, load: bool = True) -> None:
        self.episode = episode
        scope = episode_scope(episode)
        known: dict[str, str] = {}
        counters: dict[str, int] = {}
        if load:
            for fp, placeholder, kind in EpisodeSecret.objects.filter(
                episode_id=episode.pk
            ).values_list("fingerprint", "placeholder", "kind"):
                known[fp] = placeholder
                n = int(placeholder.rsplit(":", 1)[1].rstrip(">"))
                counters[kind] = max(counters.get(kind, 0), n)
        self.redactor = Redactor(
            scope=scope,
            fingerprint=lambda value: crypto.fingerprint(scope, value),
            known=known,
            counters=counters,
        )

    def redact(self, value: Any, path: str) -> Any:
        return self.redactor.value(value, path)

    def text(self, value: str, path: str) -> str:
        return self.redactor.text(value, path)

    def save(self, *, count_known: bool = True) -> int:
        """Stores the new secrets (encrypted) and adds to the occurrence counts (of the
        secrets already known too, unless ``count_known`` is false: an export replaces
        again what was already counted at ingestion). Returns how many replacements
        were made in this session."""
        fresh = {f.placeholder for f in self.redactor.found}
        rows = [
            EpisodeSecret(
                tenant_id=self.episode.tenant_id,
                episode_id=self.episode.pk,
                kind=f.kind,
                placeholder=f.placeholder,
                fingerprint=crypto.fingerprint(self.redactor.scope, f.secret),
                value_encrypted=crypto.encrypt(f.secret),
                first_path=f.path[:300],
                occurrences=self.redactor.uses.get(f.placeholder, 1),
            )
            for f in self.redactor.found
        ]
        if rows:
            EpisodeSecret.objects.bulk_create(rows)
        for placeholder, n in self.redactor.uses.items():
            if count_known and placeholder not in fresh:
                EpisodeSecret.objects.filter(
                    episode_id=self.episode.pk, placeholder=placeholder
                ).update(occurrences=F("occurrences") + n)
        total = sum(self.redactor.hits.values())
        self.redactor.found.clear()
        self.redactor.hits.clear()
        self.redactor.uses.clear()
        return total


def episode_secrets_reveal(*, episode: Episode, actor: str) -> list[dict[str, Any]]:
    """The placeholder → value mapping of an episode, decrypted, for a tenant admin (the
    view checks the scope). Every call writes a SecretAccess row first."""
    rows = list(EpisodeSecret.objects.filter(episode=episode))
    SecretAccess.objects.create(
        tenant=episode.tenant,
        episode_ref=episode.episode_id,
        actor=actor,
        placeholders=[r.placeholder for r in rows],
    )
    return [
        {
            "placeholder": r.placeholder,
            "kind": r.kind,
            "value": crypto.decrypt(r.value_encrypted, what="a redacted trajectory secret"),
            "first_path": r.first_path,
            "occurrences": r.occurrences,
        }
        for r in rows
    ]


def secrets_report(*, tenant: Tenant, episodes: QuerySet[Episode]) -> dict[str, Any]:
    """What redaction found in these episodes, by kind (no values)."""
    rows = (
        EpisodeSecret.objects.filter(tenant=tenant, episode__in=episodes)
        .order_by()
        .values("kind")
        .annotate(
            secrets=Count("pk"),
            uses=Sum("occurrences"),
            episodes=Count("episode", distinct=True),
        )
        .order_by("kind")
    )
    by_kind = {
        r["kind"]: {
            "secrets": int(r["secrets"]),
            "occurrences": int(r["uses"] or 0),
            "episodes": int(r["episodes"]),
        }
        for r in rows
    }
    return {
        "episodes_scanned": episodes.count(),
        "episodes_with_secrets": EpisodeSecret.objects.filter(tenant=tenant, episode__in=episodes)
        .values("episode")
        .distinct()
        .count(),
        "secrets": sum(v["secrets"] for v in by_kind.values()),
        "by_kind": by_kind,
    }


def scan_lines(lines: list[bytes]) -> dict[str, Any]:
    """A dry run over a client's data (``hedgerow trajectories scan FILE``): what would
    be replaced, by kind, with where it was found. Nothing is stored, no value returned."""
    from collections import Counter

    from apps.trajectories.redaction import Redactor

    redactor = Redactor(scope="00000000", fingerprint=lambda value: value)
    scanned = 0
    for number, raw in enumerate(lines, start=1):
        text = raw.decode("utf-8", "replace")
        if not text.strip():
            continue
        scanned += 1
        try:
            value: Any = json_loads(text)
        except Exception:  # noqa: BLE001 - not JSON: scanned as text
            value = text
        redactor.value(value, f"line {number}")
    distinct: Counter[str] = Counter(f.kind for f in redactor.found)
    return {
        "lines": scanned,
        "secrets": sum(distinct.values()),
        "occurrences": sum(redactor.hits.values()),
        "by_kind": {
            kind: {
                "secrets": distinct[kind],
                "occurrences": redactor.hits[kind],
                "paths": sorted(redactor.paths.get(kind, set()))[:20],
            }
            for kind in sorted(redactor.hits)
        },
    }
