"""Images through the SDK and the CLI against the real stack and registry fixtures:
pull with progress, list, get, remove, import, typed errors carrying the code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import hedgerow
import pytest
from hedgerow import AsyncClient, Client

from apps.images.models import Image
from apps.images.tests.conftest import layout_tarball, push_image
from apps.orchard.tests.live import wait_all_deleted
from apps.sandboxes.models import Sandbox

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


def _repo(name: str) -> str:
    """A repository name unique to this run (the registries live for the session)."""
    return f"t{uuid.uuid4().hex[:10]}/{name}"


def _cli(live, secret: str, *args: str, progress: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEDGEROW_")}
    env.update({"HEDGEROW_URL": live.url, "HEDGEROW_API_KEY": secret, "PYTHONPATH": str(SDK_DIR)})
    if progress:
        env["HEDGEROW_PROGRESS"] = "1"  # the terminal rendering, without a terminal
    return subprocess.run(
        [sys.executable, "-m", "hedgerow.cli", *args],
        env=env,
        input="",
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_the_sdk_pulls_lists_gets_removes_and_imports_images(
    live, make_tenant, open_registry, tmp_path
):
    tenant, secret = make_tenant()
    ref, digest = push_image(open_registry, tmp_path, _repo("sdk"))
    seen: list[dict[str, object]] = []
    with Client(live.url, secret) as hr:
        image = hr.images.pull(ref, progress=seen.append, poll_interval=0.1)
        assert (image.status, image.digest, image.reference) == ("ready", digest, ref)
        assert image.size_bytes > 0 and image.layers == 1
        assert seen and seen[0]["phase"] == "queued"  # the record as first answered
        assert all(set(p) == {"phase", "layers", "bytes", "total"} for p in seen)
        assert [i.id for i in hr.images.list()] == [image.id]
        assert hr.images.get(image.id).digest == digest

        with pytest.raises(hedgerow.ImageUnavailable) as missing:
            hr.images.pull(f"{open_registry.host}/{_repo('missing')}:v1")
        assert missing.value.code == "image_not_found" and missing.value.status == 422
        assert missing.value.reference is not None and "missing" in missing.value.reference
        with pytest.raises(hedgerow.InvalidImageReference) as invalid:
            hr.images.pull("Not A Reference!")
        assert invalid.value.code == "image_reference_invalid"
        with pytest.raises(hedgerow.NotFound):
            hr.images.get("00000000-0000-0000-0000-000000000000")

        tarball, imported_digest = layout_tarball(tmp_path)
        (tmp_path / "image.tar").write_bytes(tarball)
        imported = hr.images.import_(tmp_path / "image.tar", "local/imported:1")
        assert (imported.status, imported.digest) == ("ready", imported_digest)
        with pytest.raises(hedgerow.HedgerowError) as no_file:
            hr.images.import_(tmp_path / "nope.tar", "local/x:1")
        assert no_file.value.code == "file_not_found"

        hr.images.remove(image.id)
        assert {i.id for i in hr.images.list()} == {imported.id}
    assert not Image.objects.filter(tenant=tenant, pk=image.id).exists()
    wait_all_deleted(tenant)


def test_the_async_client_pulls_and_removes_images(live, make_tenant, open_registry, tmp_path):
    import asyncio

    tenant, secret = make_tenant()
    ref, digest = push_image(open_registry, tmp_path, _repo("aio"))

    async def main() -> tuple[str, list[str]]:
        async with AsyncClient(live.url, secret) as hr:
            image = await hr.images.pull(ref, poll_interval=0.1)
            listed = [i.digest for i in await hr.images.list()]
            await hr.images.remove(image.id)
            return image.status, listed

    assert asyncio.run(main()) == ("ready", [digest])
    assert not Image.objects.filter(tenant=tenant).exists()
    wait_all_deleted(tenant)


def test_the_cli_pulls_lists_removes_and_imports_images(live, make_tenant, open_registry, tmp_path):
    tenant, secret = make_tenant()
    ref, digest = push_image(open_registry, tmp_path, _repo("cli"))

    pulled = _cli(live, secret, "image", "pull", ref)
    assert pulled.returncode == 0, pulled.stderr
    image_id, status, got_digest = pulled.stdout.split()
    assert (status, got_digest) == ("ready", digest)
    assert "queued layers=" in pulled.stderr  # plain progress lines off a terminal
    assert "pulling " not in pulled.stderr  # no bar

    again = _cli(live, secret, "--json", "image", "pull", ref)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["id"] == image_id  # one record per reference

    other, _ = push_image(open_registry, tmp_path, _repo("bar"))
    barred = _cli(live, secret, "image", "pull", other, progress=True)
    assert barred.returncode == 0, barred.stderr
    # (text mode reads the bar's \r as a newline)
    assert f"pulling {other} queued" in barred.stderr and "[---" in barred.stderr
    assert _cli(live, secret, "image", "rm", barred.stdout.split()[0]).returncode == 0

    listed = _cli(live, secret, "image", "ls")
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:2] == ["ID", "STATUS"]
    assert [line.split()[0] for line in lines[1:]] == [image_id]

    missing = _cli(live, secret, "image", "pull", f"{open_registry.host}/{_repo('x')}:v1")
    assert missing.returncode == 1 and "image_not_found" in missing.stderr

    tarball, imported_digest = layout_tarball(tmp_path)
    (tmp_path / "image.tar").write_bytes(tarball)
    imported = _cli(
        live, secret, "--json", "image", "import", str(tmp_path / "image.tar"),
        "--reference", "local/cli:1",
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["digest"] == imported_digest

    removed = _cli(live, secret, "image", "rm", image_id)
    assert removed.returncode == 0, removed.stderr
    assert not Image.objects.filter(tenant=tenant, pk=image_id).exists()
    gone = _cli(live, secret, "image", "rm", image_id)
    assert gone.returncode == 1 and image_id in gone.stderr
    assert _cli(live, secret, "image", "rm").returncode == 2
    wait_all_deleted(tenant)


def test_create_sandbox_of_an_image_it_cannot_have_raises_the_typed_error(
    live, make_tenant, open_registry
):
    tenant, secret = make_tenant()
    missing = f"{open_registry.host}/{_repo('nothing')}:v1"
    with Client(live.url, secret) as hr:
        with pytest.raises(hedgerow.ImageUnavailable) as err:
            hr.create_sandbox(image=missing)
        assert (err.value.code, err.value.status, err.value.reference) == (
            "image_not_found",
            422,
            missing,
        )
        with pytest.raises(hedgerow.InvalidImageReference) as bad:
            hr.create_sandbox(image="Not A Reference!")
        assert (bad.value.code, bad.value.status) == ("image_reference_invalid", 400)
    # nothing was created, and nothing ran on `host` instead
    assert not Sandbox.objects.filter(tenant=tenant).exists()
