"""Images and registry credentials as tenant resources: the rules live here; views
and tasks only call these functions.

* A reference is normalised once (``python:3.12`` → ``docker.io/library/python:3.12``)
  and one ``Image`` row exists per (tenant, reference).
* Every pull, resolve and sandbox create uses the tenant's own credentials for the
  reference's registry (``credentials_for``); access is proved against the registry
  on every request, so a tenant never gets an image another tenant's login fetched.
* Errors are the backend's typed codes, mapped to HTTP without parsing messages
  (``image_api_error``); never a fallback to another image.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, transaction
from django.db.models import Count, IntegerField, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from apps.core.errors import ApiError, Conflict, NotFound, ValidationFailed
from apps.images import crypto
from apps.images.models import Image, ImageStatus, RegistryCredential
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import (
    BackendError,
    DiskExhausted,
    ImageInfo,
    ImageUnavailable,
    RegistryCredentials,
)
from apps.sandboxes.backends.local.images import ImageError
from apps.sandboxes.backends.local.images import parse as parse_reference
from apps.sandboxes.events import publish_tenant_event
from apps.sandboxes.models import LIVE_STATES, Sandbox
from apps.sandboxes.pull_progress import PROGRESS_MIN_INTERVAL_S, merge_progress
from apps.tenancy.models import Tenant

log = logging.getLogger(__name__)

HOST_IMAGE = "host"
# A row still ``pulling`` with no progress written for this long lost its worker: a new
# POST starts the pull again instead of returning the dead one forever.
PULL_STALE_S = 300
WAIT_MAX_S = 600.0

# code → HTTP status (docs/images.md); every other image code is a 422
_STATUS = {"image_reference_invalid": 400, "image_in_use": 409, "disk_exhausted": 507}
_DOCKER_HUB_ALIASES = {"index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
_REGISTRY_HOST = re.compile(
    r"^(?:[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:]+\])(?::[0-9]{1,5})?$"
)


# --- errors -----------------------------------------------------------------------


def image_api_error(exc: BackendError, reference: str) -> ApiError:
    """The backend's typed image error as the API's envelope: ``code`` unchanged,
    ``field: "image"``, the reference asked for."""
    if isinstance(exc, DiskExhausted):
        code = "disk_exhausted"
    elif isinstance(exc, ImageUnavailable):
        code = exc.code
    else:
        code = "image_store_error"
    return ApiError(
        str(exc),
        code=code,
        field="image",
        status_code=_STATUS.get(code, 422),
        extra={"reference": reference},
    )


def normalise_reference(reference: Any) -> str:
    """The canonical reference (Docker's rules), or a 400 ``image_reference_invalid``."""
    if not isinstance(reference, str) or not reference:
        raise ApiError(
            "reference is required (e.g. python:3.12-slim)",
            code="image_reference_invalid",
            field="reference",
            extra={"reference": reference if isinstance(reference, str) else ""},
        )
    try:
        return str(parse_reference(reference))
    except ImageError as exc:
        raise ApiError(
            f"{reference}: {exc.message}",
            code="image_reference_invalid",
            field="reference",
            extra={"reference": reference},
        ) from exc


# --- registry credentials ------------------------------------------------------------


def normalise_registry(registry: Any) -> str:
    if not isinstance(registry, str) or not registry.strip():
        raise ValidationFailed("registry is required (a host[:port])", field="registry")
    host = registry.strip().lower()
    for prefix in ("https://", "http://"):
        host = host.removeprefix(prefix)
    host = host.rstrip("/")
    if host in _DOCKER_HUB_ALIASES:
        host = "docker.io"
    if not _REGISTRY_HOST.match(host) or len(host) > 255:
        raise ValidationFailed(
            f"{registry!r} is not a registry host[:port] (e.g. ghcr.io, registry.lan:5000)",
            field="registry",
        )
    return host


def credential_create(
    *, tenant: Tenant, registry: Any, username: Any, password: Any
) -> RegistryCredential:
    """Stores (or replaces) the tenant's login for ``registry``; the password is
    encrypted before it reaches the database and is never returned."""
    host = normalise_registry(registry)
    if not isinstance(username, str) or not username or len(username) > 255:
        raise ValidationFailed("username is required (at most 255 characters)", field="username")
    if not isinstance(password, str) or not password or len(password) > 4096:
        raise ValidationFailed("password is required (at most 4096 characters)", field="password")
    encrypted = crypto.encrypt(password)
    with transaction.atomic():
        cred, _ = RegistryCredential.objects.update_or_create(
            tenant=tenant,
            registry=host,
            defaults={
                "username": username,
                "password_encrypted": encrypted,
                "created_at": timezone.now(),
            },
        )
    log.info("registry credential stored", extra={"tenant": tenant.slug, "registry": host})
    return cred


def credential_get(*, tenant: Tenant | None, credential_id: str) -> RegistryCredential:
    try:
        return RegistryCredential.objects.for_tenant(tenant).get(pk=credential_id)
    except (RegistryCredential.DoesNotExist, ValueError, DjangoValidationError):
        raise NotFound(
            f"no registry credential {credential_id!r}", code="registry_credential_not_found"
        ) from None


def credential_delete(*, credential: RegistryCredential) -> None:
    credential.delete()


def credentials_for(tenant: Tenant, reference: str) -> RegistryCredentials | None:
    """The tenant's credentials for ``reference``'s registry (decrypted, in memory
    only), or None for an anonymous pull. ``host`` and unparsable names: None."""
    if reference == HOST_IMAGE:
        return None
    try:
        registry = parse_reference(reference).registry
    except ImageError:
        return None
    cred = RegistryCredential.objects.filter(tenant=tenant, registry=registry.lower()).first()
    if cred is None:
        return None
    return RegistryCredentials(cred.username, crypto.decrypt(cred.password_encrypted))


# --- images -------------------------------------------------------------------------


def image_list(*, tenant: Tenant | None) -> QuerySet[Image]:
    return _with_sandbox_counts(Image.objects.for_tenant(tenant))


def image_get(*, tenant: Tenant | None, image_id: str) -> Image:
    try:
        return _with_sandbox_counts(Image.objects.for_tenant(tenant)).get(pk=image_id)
    except (Image.DoesNotExist, ValueError, DjangoValidationError):
        raise NotFound(f"no image {image_id!r}", code="image_not_found_here") from None


def _with_sandbox_counts(qs: QuerySet[Image]) -> QuerySet[Image]:
    live = (
        Sandbox.objects.filter(
            tenant=OuterRef("tenant"), image_digest=OuterRef("digest"), state__in=LIVE_STATES
        )
        .exclude(image_digest="")
        .order_by()
        .values("tenant")
        .annotate(n=Count("id"))
        .values("n")
    )
    return qs.annotate(
        live_sandboxes=Coalesce(Subquery(live, output_field=IntegerField()), Value(0))
    )


def image_pull_request(*, tenant: Tenant, reference: Any) -> tuple[Image, bool]:
    """Proves access now (the manifest, with the tenant's credentials: a typed 4xx,
    nothing recorded) and records a ``pulling`` row whose pull runs in a worker.

    Single-flight per (tenant, reference): while a pull is in flight, a second request
    returns the same row (started=False). A ready or failed row is pulled again (a tag
    may have moved)."""
    from apps.images.tasks import pull_image

    ref = normalise_reference(reference)
    creds = credentials_for(tenant, ref)
    backend = get_backend()
    try:
        info = backend.resolve_image(ref, creds)
    except BackendError as exc:
        raise image_api_error(exc, ref) from exc
    stale = timezone.now() - timedelta(seconds=PULL_STALE_S)
    for _ in range(2):  # a concurrent first POST may win the insert: then lock its row
        try:
            with transaction.atomic():
                image = (
                    Image.objects.select_for_update().filter(tenant=tenant, reference=ref).first()
                )
                if image is None:
                    image = Image.objects.create(
                        tenant=tenant,
                        reference=ref,
                        digest=info.digest,
                        private=creds is not None,
                        progress=merge_progress({"phase": "queued"}),
                    )
                elif image.status == ImageStatus.PULLING and image.updated_at > stale:
                    return image, False
                else:
                    image.status = ImageStatus.PULLING
                    image.digest = info.digest
                    image.private = creds is not None
                    image.progress = merge_progress({"phase": "queued"})
                    image.error_code = image.error_message = ""
                    image.save()
                image_id = str(image.pk)
                transaction.on_commit(functools.partial(pull_image.delay, image_id))
                return image, True
        except IntegrityError:
            continue
    raise Conflict("a concurrent pull of this image is starting; retry", code="image_busy")


def image_wait(*, image: Image, timeout_s: float) -> Image:
    """Until the pull ends or ``timeout_s`` passes (polls the row; bounded)."""
    deadline = time.monotonic() + min(max(timeout_s, 0.0), WAIT_MAX_S)
    while image.status == ImageStatus.PULLING and time.monotonic() < deadline:
        time.sleep(0.2)
        fresh = Image.objects.filter(pk=image.pk).first()
        if fresh is None:
            break
        image = fresh
    return image


@dataclass
class ProgressWriter:
    """The pull's progress callback: merged into the contract's shape, written to the
    row and published to the tenant's realtime feed at most every 0.25 s."""

    image_id: str
    tenant_id: str
    reference: str
    last: dict[str, Any] | None = None
    written_at: float = 0.0

    def __call__(self, event: dict[str, Any]) -> None:
        self.last = merge_progress(event, self.last)
        now = time.monotonic()
        if now - self.written_at < PROGRESS_MIN_INTERVAL_S:
            return
        self.written_at = now
        Image.objects.filter(pk=self.image_id, status=ImageStatus.PULLING).update(
            progress=self.last, updated_at=timezone.now()
        )
        publish_image(self.tenant_id, self.image_id, self.reference, "pulling", self.last)


def publish_image(
    tenant_id: str,
    image_id: str,
    reference: str,
    status: str,
    progress: dict[str, Any] | None,
    error: dict[str, str] | None = None,
) -> None:
    publish_tenant_event(
        tenant_id,
        {
            "type": "image.progress",
            "image_id": image_id,
            "reference": reference,
            "status": status,
            "progress": progress,
            "error": error,
        },
    )


def image_pull_run(*, image_id: str) -> Image | None:
    """The worker's half of a pull (Celery task ``pull_image``): fetch and unpack with
    the tenant's credentials, then ``ready`` (digest, size, layers) or ``failed`` with
    the typed code. Idempotent: a row that is no longer ``pulling`` is left alone."""
    image = Image.objects.select_related("tenant").filter(pk=image_id).first()
    if image is None or image.status != ImageStatus.PULLING:
        return image
    tenant_id = str(image.tenant_id)
    writer = ProgressWriter(image_id, tenant_id, image.reference, last=image.progress)
    try:
        creds = credentials_for(image.tenant, image.reference)
        info = get_backend().pull_image(image.reference, creds, progress=writer)
    except (BackendError, crypto.CredentialKeyError) as exc:
        code = (
            exc.code
            if isinstance(exc, ImageUnavailable)
            else "disk_exhausted"
            if isinstance(exc, DiskExhausted)
            else "image_store_error"
        )
        log.warning("pull of %s failed: %s", image.reference, code)
        Image.objects.filter(pk=image_id, status=ImageStatus.PULLING).update(
            status=ImageStatus.FAILED,
            error_code=code,
            error_message=str(exc)[:2000],
            progress=None,
            updated_at=timezone.now(),
        )
        publish_image(
            tenant_id,
            image_id,
            image.reference,
            "failed",
            None,
            {"code": code, "message": str(exc)},
        )
    else:
        _mark_ready(image_id, info)
        publish_image(tenant_id, image_id, image.reference, "ready", None)
    return Image.objects.filter(pk=image_id).first()


def _mark_ready(image_id: str, info: ImageInfo) -> None:
    Image.objects.filter(pk=image_id).update(
        status=ImageStatus.READY,
        digest=info.digest,
        size_bytes=info.size_bytes,
        layers=info.layers,
        progress=None,
        error_code="",
        error_message="",
        updated_at=timezone.now(),
    )


def image_import(*, tenant: Tenant, reference: Any, upload: IO[bytes]) -> Image:
    """An uploaded OCI layout tarball or ``docker save`` tarball, stored under
    ``reference`` (a ``ready`` row at once). The upload is copied to a private temp
    file first; a bad archive is a 422 ``image_archive_invalid`` and records nothing."""
    ref = normalise_reference(reference)
    tmp_root = Path(settings.STATE_DIR) / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tmp_root, prefix="image-import-") as tmp:
        os.chmod(tmp, 0o700)
        path = Path(tmp) / "image.tar"
        with open(path, "wb") as out:
            shutil.copyfileobj(upload, out, 1 << 20)
        source = _oci_layout_dir(path, Path(tmp) / "layout", ref) or path
        try:
            info = get_backend().import_image(ref, source)
        except ImageUnavailable as exc:
            raise image_api_error(exc, ref) from exc
        except DiskExhausted as exc:
            raise image_api_error(exc, ref) from exc
        except BackendError as exc:
            raise ApiError(
                f"{ref}: not an OCI layout or docker save tarball ({exc})",
                code="image_archive_invalid",
                field="file",
                status_code=422,
                extra={"reference": ref},
            ) from exc
    with transaction.atomic():
        image, _ = Image.objects.update_or_create(
            tenant=tenant,
            reference=ref,
            defaults={
                "status": ImageStatus.READY,
                "digest": info.digest,
                "size_bytes": info.size_bytes,
                "layers": info.layers,
                "progress": None,
                "error_code": "",
                "error_message": "",
                "private": True,
                "imported": True,
            },
        )
    return image_get(tenant=tenant, image_id=str(image.pk))


def _oci_layout_dir(tarball: Path, target: Path, reference: str) -> Path | None:
    """An OCI layout tarball unpacked into ``target`` (the backend imports a layout
    directory); None for anything else (a ``docker save`` tarball goes as it is).
    Only regular files and directories inside ``target`` (tarfile's ``data`` filter:
    no links out, no devices, no absolute or ``..`` paths)."""
    try:
        with tarfile.open(tarball) as tar:
            names = {m.name.lstrip("./") for m in tar.getmembers()}
            if "oci-layout" not in names or "manifest.json" in names:
                return None
            target.mkdir(mode=0o700)
            for member in tar.getmembers():
                if not (member.isfile() or member.isdir()):
                    raise tarfile.FilterError(f"{member.name}: not a file or directory")
            tar.extractall(target, filter="data")
    except tarfile.TarError as exc:
        if target.exists():
            raise ApiError(
                f"{reference}: the OCI layout tarball cannot be unpacked ({exc})",
                code="image_archive_invalid",
                field="file",
                status_code=422,
                extra={"reference": reference},
            ) from exc
        return None
    return target


def image_delete(*, tenant: Tenant, image: Image) -> None:
    """Forgets the tenant's image; 409 ``image_in_use`` while one of the tenant's live
    sandboxes runs it. The cached content goes only when no other record (any tenant)
    and no live sandbox use its digest; a backend lease keeps it until collection."""

    digest = image.digest
    with transaction.atomic():
        locked = Image.objects.select_for_update().filter(pk=image.pk, tenant=tenant).first()
        if locked is None:
            raise NotFound(f"no image {image.pk}", code="image_not_found_here")
        if (
            digest
            and Sandbox.objects.filter(
                tenant=tenant, image_digest=digest, state__in=LIVE_STATES
            ).exists()
        ):
            raise ApiError(
                f"{image.reference} is used by a live sandbox; delete the sandbox first",
                code="image_in_use",
                status_code=409,
                field="image",
                extra={"reference": image.reference},
            )
        locked.delete()
        shared = bool(digest) and (
            Image.objects.filter(digest=digest).exists()
            or Sandbox.objects.filter(image_digest=digest, state__in=LIVE_STATES).exists()
        )
    if digest and not shared:
        try:
            if not get_backend().remove_image(digest):
                log.info("image %s still leased; left for collection", digest)
        except BackendError as exc:
            log.warning("could not remove image %s: %s", digest, exc)


# --- sandboxes ----------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedImage:
    digest: str  # "" for host and legacy images without one
    credentials: RegistryCredentials | None


def image_resolve_for_sandbox(*, tenant: Tenant, image: str) -> ResolvedImage:
    """Synchronously, for a sandbox create: the image can be had by this tenant (its
    credentials, the registry's answer now), or a typed 4xx and nothing is created."""
    if image == HOST_IMAGE:
        return ResolvedImage("", None)
    imported = (
        Image.objects.filter(tenant=tenant, imported=True, status=ImageStatus.READY)
        .filter(Q(reference=image) | Q(reference=_normalised_or_none(image)))
        .first()
    )
    if imported is not None:
        return ResolvedImage(imported.digest, None)
    creds = credentials_for(tenant, image)
    try:
        info = get_backend().resolve_image(image, creds)
    except BackendError as exc:
        raise image_api_error(exc, image) from exc
    return ResolvedImage(info.digest, creds)


def image_mark_used(*, tenant: Tenant, digests: Iterable[str]) -> None:
    found = [d for d in digests if d]
    if found:
        Image.objects.filter(tenant=tenant, digest__in=found).update(last_used_at=timezone.now())


class Catalog:
    """What the sandboxes app asks of images (``apps/sandboxes/image_catalog.py``),
    registered from ``ImagesConfig.ready``: sandboxes sit a floor below and never
    import this module."""

    def credentials_for(self, tenant: Tenant, reference: str) -> RegistryCredentials | None:
        return credentials_for(tenant, reference)

    def resolve_digest(self, tenant: Tenant, image: str) -> str:
        return image_resolve_for_sandbox(tenant=tenant, image=image).digest

    def mark_used(self, tenant: Tenant, digests: Iterable[str]) -> None:
        image_mark_used(tenant=tenant, digests=digests)


def _normalised_or_none(image: str) -> str | None:
    try:
        return str(parse_reference(image))
    except ImageError:
        return None
