"""Backfill: every existing episode gets its provenance components and keys, computed
from the fields it has (apps/trajectories/provenance.py: missing ones are ``unknown``).
Imported episodes are computed from their fields too (their lines carried none)."""

from typing import Any

from django.db import migrations

from apps.trajectories import provenance


def backfill(apps: Any, schema_editor: Any) -> None:
    Episode = apps.get_model("trajectories", "Episode")
    EpisodeSandbox = apps.get_model("trajectories", "EpisodeSandbox")
    todo = Episode.objects.filter(provenance_key="").order_by("pk")
    for episode in todo.iterator(chunk_size=500):
        snapshot_id = episode.branch_snapshot_id or (
            EpisodeSandbox.objects.filter(episode=episode, sandbox__snapshot__isnull=False)
            .order_by("attached_at", "id")
            .values_list("sandbox__snapshot_id", flat=True)
            .first()
        )
        parts = provenance.components(
            task_hash=episode.task_hash,
            image_digest=episode.image_digest,
            snapshot_id=str(snapshot_id) if snapshot_id else None,
            policy_checkpoint=episode.policy_checkpoint,
            policy_version=episode.policy_version,
            harness_commit=episode.harness_commit,
            verifier_commit=episode.verifier_commit,
            verifier_version=episode.verifier_version,
            sampling=episode.sampling,
            attempt_id=episode.attempt_id,
        )
        Episode.objects.filter(pk=episode.pk).update(
            provenance=parts,
            provenance_key=provenance.key_of(parts),
            provenance_origin=provenance.origin_of(parts),
        )


class Migration(migrations.Migration):
    dependencies = [
        ("trajectories", "0005_episode_provenance_keys"),
    ]

    operations = [migrations.RunPython(backfill, migrations.RunPython.noop)]
