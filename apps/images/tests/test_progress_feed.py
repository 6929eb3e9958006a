"""A pull's progress reaches the owning team's dashboard socket (``image.progress`` on
the ``sandboxes`` topic of /ws/realtime), and no other team's."""

from __future__ import annotations

import pytest

from apps.core.asyncdb import db_async
from apps.images.models import Image
from apps.images.services import ProgressWriter
from apps.sandboxes.tests.wscomm import WebsocketCommunicator
from controlplane.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


async def _subscribed(secret: str) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(
        application, "/ws/realtime", headers=[(b"authorization", f"Bearer {secret}".encode())]
    )
    connected, _ = await comm.connect()
    assert connected
    await comm.send_json_to({"type": "subscribe", "topic": "sandboxes"})
    assert (await comm.receive_json_from(timeout=5))["type"] == "subscribed"
    return comm


async def test_pull_progress_is_sent_to_the_owning_team_only(make_tenant):
    owner, owner_secret = await db_async(make_tenant)()
    _, other_secret = await db_async(make_tenant)()
    image = await db_async(Image.objects.create)(tenant=owner, reference="ghcr.io/acme/app:1")
    mine, theirs = await _subscribed(owner_secret), await _subscribed(other_secret)
    writer = ProgressWriter(str(image.pk), str(owner.pk), image.reference)
    await db_async(writer)({"phase": "fetching", "layers": 2, "bytes": 5, "total": 10})
    event = await mine.receive_json_from(timeout=5)
    assert event == {
        "type": "image.progress",
        "image_id": str(image.pk),
        "reference": "ghcr.io/acme/app:1",
        "status": "pulling",
        "progress": {"phase": "fetching", "layers": 2, "bytes": 5, "total": 10},
        "error": None,
    }
    assert await theirs.receive_nothing(timeout=0.5)
    stored = await db_async(lambda: Image.objects.get(pk=image.pk).progress)()
    assert stored == event["progress"]
    await mine.disconnect()
    await theirs.disconnect()
