"""`manage.py hedgerow_backend_cleanup` (what `make down` runs): every sandbox of the
installation and the agent zygote are gone afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command

from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local._sys import is_alive
from apps.sandboxes.backends.tests.conftest import make_config, needs_root, new_spec
from apps.sandboxes.management.commands import hedgerow_backend_cleanup
from apps.sandboxes.models import WarmMember, WarmMemberState


@pytest.fixture
def private_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalBackend]:
    # Its own instance: the command destroys everything of the backend it is given,
    # which must not be the one the rest of the test run uses.
    backend = LocalBackend(make_config(tmp_path, f"cl{os.getpid()}{uuid.uuid4().hex[:4]}"))
    monkeypatch.setattr(hedgerow_backend_cleanup, "get_backend", lambda: backend)
    try:
        yield backend
    finally:
        backend.teardown_instance()


@needs_root
def test_it_destroys_every_sandbox_and_stops_the_zygote(
    private_backend: LocalBackend, db: None
) -> None:
    specs = [new_spec(), new_spec()]
    for spec in specs:
        wait_healthy(private_backend.provision(spec), spec.agent_token, timeout=20)
    # The second one is a warm pool member: its row goes with its resources.
    member = WarmMember.objects.create(
        id=uuid.UUID(hex=specs[1].sandbox_id),
        backend="local",
        image="host",
        cpu_millis=1000,
        memory_mib=1024,
        state=WarmMemberState.WARM,
    )
    answer = private_backend.zygote.ping()
    assert private_backend.agent_launch == "zygote" and answer is not None
    call_command("hedgerow_backend_cleanup")
    assert [i for i in private_backend.inventory() if i.sandbox_id] == []
    assert not WarmMember.objects.filter(pk=member.pk).exists()
    assert not is_alive(int(answer["pid"]), None)
    assert private_backend.zygote.ping() is None
    # the sandbox storage is unmounted (its loop device released), its image kept
    storage = private_backend.storage
    assert storage is not None and not storage.mounted() and storage.image.exists()
