"""OCI images of the team (``client.images`` / ``await async_client.images``).

    image = client.images.pull("python:3.12-slim", progress=print)   # waits until ready
    client.images.list(); client.images.get(image.id); client.images.remove(image.id)
    client.images.import_("image.tar", "my/app:1")                    # OCI or docker save

A pull is answered at once (the server proves access to the manifest with the team's
registry credentials, or raises a typed error) and runs in a worker; ``pull`` then
polls the record every ``poll_interval`` seconds, calls ``progress`` with each new
``{"phase", "layers", "bytes", "total"}``, and raises ``ImageUnavailable`` (its
``code`` says why: ``image_not_found``, ``registry_unauthorized``, …) if the pull fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Union

from hedgerow.errors import HedgerowError, error_from_response

if TYPE_CHECKING:
    from hedgerow.aio import AsyncClient
    from hedgerow.client import Client

ProgressCallback = Optional[Callable[[Dict[str, Any]], None]]
DEFAULT_PULL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Image:
    """One image record: ``status`` is ``pulling``, ``ready`` or ``failed``;
    ``size_bytes`` and ``layers`` once ready; ``sandboxes`` = live sandboxes using it."""

    id: str
    reference: str
    digest: str
    status: str
    size_bytes: int
    layers: int
    progress: Optional[Dict[str, Any]]
    error: Optional[Dict[str, Any]]
    sandboxes: int
    private: bool
    created_at: str
    last_used_at: Optional[str]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_api(cls, body: Dict[str, Any]) -> Image:
        return cls(
            id=str(body["id"]),
            reference=str(body.get("reference", "")),
            digest=str(body.get("digest") or ""),
            status=str(body.get("status", "")),
            size_bytes=int(body.get("size_bytes") or 0),
            layers=int(body.get("layers") or 0),
            progress=body.get("progress"),
            error=body.get("error"),
            sandboxes=int(body.get("sandboxes") or 0),
            private=bool(body.get("private")),
            created_at=str(body.get("created_at") or ""),
            last_used_at=body.get("last_used_at"),
            raw=body,
        )


def failure(image: Image) -> HedgerowError:
    """The typed error of a failed pull, from the record's ``error``."""
    error = image.error or {}
    return error_from_response(
        422,
        {
            "error": {
                "code": str(error.get("code") or "image_store_error"),
                "message": str(error.get("message") or "the pull failed"),
                "field": "image",
                "reference": image.reference,
            }
        },
    )


def _upload(path: Union[str, Path]) -> tuple[str, Any]:
    """(file name, file object) for an import: a tarball as is, an OCI layout directory
    tarred in memory."""
    source = Path(path)
    if not source.exists():
        raise HedgerowError(f"{source}: no such file or directory", code="file_not_found")
    if source.is_dir():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(source, arcname=".")
        buffer.seek(0)
        return f"{source.name}.tar", buffer
    return source.name, open(source, "rb")


class Images:
    """``client.images``: pull, list, get, remove, import_."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def pull(
        self,
        reference: str,
        *,
        progress: ProgressCallback = None,
        wait: bool = True,
        timeout: float = DEFAULT_PULL_TIMEOUT_S,
        poll_interval: float = 0.5,
    ) -> Image:
        """Pulls ``reference`` with the team's credentials for its registry. With
        ``wait`` (default) returns once ready (``timeout`` seconds, default 600), calling
        ``progress(dict)`` on each change; raises the typed error if it fails."""
        body = self._client.request("POST", "/images", json={"reference": reference}).json()
        image = Image.from_api(body)
        if not wait:
            return image
        deadline = time.monotonic() + timeout
        seen: Optional[Dict[str, Any]] = None
        while True:
            if progress is not None and image.progress and image.progress != seen:
                seen = image.progress
                progress(dict(seen))
            if image.status == "ready":
                return image
            if image.status == "failed":
                raise failure(image)
            if time.monotonic() >= deadline:
                raise HedgerowError(
                    f"{reference}: still pulling after {timeout:g} s", code="wait_timeout"
                )
            time.sleep(poll_interval)
            image = self.get(image.id)

    def list(self, *, page_size: int = 100) -> List[Image]:
        """Every image of the team, fetched page by page."""
        images: List[Image] = []
        offset = 0
        while True:
            page = self._client.request(
                "GET", "/images", params={"limit": page_size, "offset": offset}
            ).json()
            images.extend(Image.from_api(item) for item in page["results"])
            if not page.get("next"):
                return images
            offset += page_size

    def get(self, image_id: str) -> Image:
        """One image by id (``NotFound`` for another team's)."""
        return Image.from_api(self._client.request("GET", f"/images/{image_id}").json())

    def remove(self, image_id: str) -> None:
        """Forgets the image; ``ImageInUse`` (409) while a live sandbox runs it."""
        self._client.request("DELETE", f"/images/{image_id}")

    def import_(self, path: Union[str, Path], reference: str) -> Image:
        """Uploads an OCI layout (tarball or directory) or a ``docker save`` tarball as
        ``reference``; the image is ready at once."""
        name, handle = _upload(path)
        with contextlib.closing(handle):
            body = self._client.request(
                "POST",
                "/images/import",
                data={"reference": reference},
                files={"file": (name, handle, "application/x-tar")},
                retry=False,
                timeout=600,
            ).json()
        return Image.from_api(body)


class AsyncImages:
    """``async_client.images``: the same calls as ``Images``, as coroutines."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def pull(
        self,
        reference: str,
        *,
        progress: ProgressCallback = None,
        wait: bool = True,
        timeout: float = DEFAULT_PULL_TIMEOUT_S,
        poll_interval: float = 0.5,
    ) -> Image:
        """See ``Images.pull``."""
        body = (await self._client.request("POST", "/images", json={"reference": reference})).json()
        image = Image.from_api(body)
        if not wait:
            return image
        deadline = time.monotonic() + timeout
        seen: Optional[Dict[str, Any]] = None
        while True:
            if progress is not None and image.progress and image.progress != seen:
                seen = image.progress
                progress(dict(seen))
            if image.status == "ready":
                return image
            if image.status == "failed":
                raise failure(image)
            if time.monotonic() >= deadline:
                raise HedgerowError(
                    f"{reference}: still pulling after {timeout:g} s", code="wait_timeout"
                )
            await asyncio.sleep(poll_interval)
            image = await self.get(image.id)

    async def list(self, *, page_size: int = 100) -> List[Image]:
        """See ``Images.list``."""
        images: List[Image] = []
        offset = 0
        while True:
            page = (
                await self._client.request(
                    "GET", "/images", params={"limit": page_size, "offset": offset}
                )
            ).json()
            images.extend(Image.from_api(item) for item in page["results"])
            if not page.get("next"):
                return images
            offset += page_size

    async def get(self, image_id: str) -> Image:
        """See ``Images.get``."""
        return Image.from_api((await self._client.request("GET", f"/images/{image_id}")).json())

    async def remove(self, image_id: str) -> None:
        """See ``Images.remove``."""
        await self._client.request("DELETE", f"/images/{image_id}")

    async def import_(self, path: Union[str, Path], reference: str) -> Image:
        """See ``Images.import_``."""
        name, handle = _upload(path)
        with contextlib.closing(handle):
            response = await self._client.request(
                "POST",
                "/images/import",
                data={"reference": reference},
                files={"file": (name, handle.read(), "application/x-tar")},
                retry=False,
                timeout=600,
            )
        return Image.from_api(response.json())
