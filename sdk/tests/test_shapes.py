"""The SDK's response shapes (hedgerow/shapes.py, issue 18: TypedDicts instead of
``Dict[str, Any]``) name exactly the fields the server's serializers answer, so a
field added, renamed or dropped on either side fails here; and a real sandbox's,
snapshot's and episode's JSON has those keys."""

from __future__ import annotations

import typing

import pytest
from hedgerow import Client, EpisodeData, ResourceExhausted, SandboxData, SnapshotData

from apps.sandboxes.api.serializers import SandboxSerializer, SnapshotSerializer
from apps.sandboxes.services.operations import resource_exhausted_error
from apps.trajectories.api.serializers import EpisodeSerializer


def keys(shape: type) -> set[str]:
    return set(typing.get_type_hints(shape))


@pytest.mark.parametrize(
    ("shape", "serializer"),
    [
        (SandboxData, SandboxSerializer),
        (SnapshotData, SnapshotSerializer),
        (EpisodeData, EpisodeSerializer),
    ],
    ids=lambda v: v.__name__,
)
def test_each_shape_names_the_serializers_fields(shape, serializer):
    assert keys(shape) == set(serializer.Meta.fields)


def test_the_resource_exhausted_shape_is_the_servers_error():
    error = resource_exhausted_error({"kind": "pids", "limit": 64}, {"signal": 9})
    assert keys(ResourceExhausted) == set(error)


def test_live_answers_have_the_shapes_keys(live, make_tenant):
    _, secret = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        assert set(sandbox.data) == keys(SandboxData)
        sandbox.refresh()
        assert set(sandbox.data) == keys(SandboxData)
        with sandbox.episode(task_id="shapes") as episode:
            assert set(episode.data) == keys(EpisodeData)  # as opened
            assert sandbox.exec("true").exit_code == 0
        assert set(episode.data) == keys(EpisodeData)  # as closed
        assert episode.data["status"] != "open"
