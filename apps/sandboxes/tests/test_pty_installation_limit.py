"""The terminal slots' installation bound (HEDGEROW_PTY_MAX_PER_INSTALLATION,
docs/realtime.md) against the real Redis: sessions of any team and sandbox count
towards it, a full installation is named as such, 0 means unlimited."""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis
from django.conf import settings as django_settings

from apps.sandboxes.services.pty import PtySlots


async def test_the_installation_bound_counts_every_team_and_names_itself(settings):
    client: aioredis.Redis = aioredis.Redis.from_url(django_settings.REDIS_URL)
    installation = f"{django_settings.REDIS_KEY_PREFIX}pty:installation"
    try:
        already = await client.zcard(installation)  # sessions other runs hold
        settings.HEDGEROW_PTY_MAX_PER_INSTALLATION = already + 2
        slots = [
            PtySlots(client, tenant_id=uuid.uuid4().hex, sandbox_pk=uuid.uuid4().hex)
            for _ in range(3)
        ]
        assert await slots[0].acquire(sandbox_limit=4, tenant_limit=4) is None
        assert await slots[1].acquire(sandbox_limit=4, tenant_limit=4) is None
        # A third team, a third sandbox: only the installation is full.
        assert await slots[2].acquire(sandbox_limit=4, tenant_limit=4) == "installation"
        await slots[0].release()
        assert await slots[2].acquire(sandbox_limit=4, tenant_limit=4) is None
        settings.HEDGEROW_PTY_MAX_PER_INSTALLATION = 0  # unlimited
        extra = PtySlots(client, tenant_id=uuid.uuid4().hex, sandbox_pk=uuid.uuid4().hex)
        assert await extra.acquire(sandbox_limit=4, tenant_limit=4) is None
        for slot in (slots[1], slots[2], extra):
            await slot.release()
    finally:
        await client.aclose()
