"""LocalBackend: one machine, one netns + bubblewrap sandbox per sandbox id."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import http.client
import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apps.core.egress import ALL, NONE, EgressError, EgressPolicy, parse_egress
from apps.sandboxes.backends.base import (
    BackendError,
    BackendEvent,
    DiskExhausted,
    Endpoint,
    ImageInfo,
    ImageUnavailable,
    InventoryItem,
    MetricsUnavailable,
    ProgressCallback,
    RegistryCredentials,
    SandboxMetrics,
    SandboxSpec,
    SnapshotFailed,
    SnapshotInfo,
    SnapshotNotFound,
    StateDivergence,
    UnknownImage,
    UnprotectedLaunch,
)
from podagent import seccomp
from podagent.userns import RANGE as USERNS_RANGE

from . import idmap, process, resolver
from . import snapshots as snaps
from ._btrfs import qgroup_name
from ._netlink import NETNS_DIR
from ._sys import (
    SYSTEM_PATH,
    file_lock,
    is_alive,
    kill_and_wait,
    kill_pids,
    proc_start_time,
    read_json,
    run,
    write_atomic,
)
from .cgroups import CgroupDriver, Limits
from .config import (
    AGENT_LAUNCH_MODES,
    ISOLATION_MODES,
    LocalBackendConfig,
    Names,
    check_image_name,
    check_instance,
    check_sandbox_id,
)
from .images import Credentials, ImageRecord, ImageStore
from .images import errors as image_errors
from .images import overlay as image_overlay
from .images import reference as image_ref
from .images import user as image_user
from .images.overlay import unmount_rootfs
from .images.skopeo import Skopeo
from .network import SNI_PORT, Network
from .storage import Storage, Volume, qgroup_of
from .zygote import (
    EXEC_HELPER_MOUNT,
    SECCOMP_FD,
    TOKEN_FD,
    ZygoteClient,
    ZygoteUnavailable,
    build_pause,
)

log = logging.getLogger(__name__)

HOST_IMAGE = "host"
RESOLVE_CACHE_S = 60.0
MS_BIND = 4096
MS_SHARED = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


# per instance: the resolv.conf of its sandboxes (``_resolv_conf``)
RESOLV_DIR = Path("/run/hedgerow/dns")


@dataclass
class _Launch:
    """How the sandbox's root and commands look: the defaults (host, legacy images)
    or an OCI image's overlay root, environment and working directory."""

    base_args: list[str]
    python: str
    root: Path | None = None
    env: dict[str, str] = field(default_factory=lambda: dict(process.SANDBOX_ENV))
    workdir: str = "/workspace"
    digest: str = ""
    user: tuple[int, int] | None = None  # commands' uid:gid, None: root
    caps: tuple[str, ...] = ()  # what root's commands keep (process.IMAGE_CAPABILITIES)
    resolv_conf: Path | None = None  # bound over /etc/resolv.conf (an allowlist's resolver)


def image_env(image: list[str]) -> dict[str, str]:
    """The commands' environment for an OCI image: the sandbox's defaults, then the
    image config's ``Env`` over them (its PATH included), as a container sees it."""
    env = dict(process.SANDBOX_ENV)
    for item in image:
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    return env


def image_workdir(working_dir: str) -> str:
    """The image config's ``WorkingDir`` as the commands' default directory
    (/workspace when unset; relative paths are taken from /, as Docker does)."""
    if not working_dir:
        return "/workspace"
    return os.path.normpath("/" + working_dir.lstrip("/"))


# A staging layout nobody writes is kept this long for a retried pull to resume, then
# it is an ``image_staging`` leftover the reconciler removes.
STAGING_STALE_S = 3600.0


def lease_holder(instance: str, sandbox_id: str) -> str:
    """The store lease name of one sandbox of one instance: ``<instance>.<sid>``.

    The store is machine-wide, so its leases are every instance's; instance ids have
    no dots, so the prefix tells this instance's leases (``inventory``) from others'."""
    return f"{instance}.{sandbox_id}"


def snapshot_holder(instance: str, snapshot_id: str) -> str:
    """The store lease name of one snapshot: never ``<instance>.<sid>``, so the
    reconciler's ``image_lease`` inventory (sandbox leases) does not see it."""
    return f"snapshot:{instance}:{snapshot_id}"


def _mount_points() -> set[str]:
    """Every mount point of this mount namespace (mountinfo's field 5, octal escapes
    such as ``\\040`` for a space decoded)."""
    points = set()
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            raw = line.split(b" ")[4]
            decoded = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), raw)
            points.add(os.fsdecode(decoded))
    return points


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _is_sandbox_id(name: str) -> bool:
    try:
        check_sandbox_id(name)
    except BackendError:
        return False
    return True


def _credential_key(credentials: RegistryCredentials | None) -> str:
    if credentials is None:
        return ""
    raw = f"{credentials.username}\0{credentials.password}".encode()
    return hashlib.sha256(raw).hexdigest()


@contextlib.contextmanager
def _typed_image_errors(reference: str) -> Iterator[None]:
    """The store's typed errors as the backend contract's: the control plane maps
    ``code`` to a 4xx without knowing this backend."""
    try:
        yield
    except image_errors.DiskExhausted as exc:
        raise DiskExhausted(f"{reference}: {exc.message}") from exc
    except image_errors.ImageError as exc:
        # the tenant gets the code's message; the operator the raw one (skopeo's words)
        log.warning("image %s refused: %s: %s", reference, exc.code, exc.detail)
        raise ImageUnavailable(
            f"{exc.reference}: {exc.message}", code=exc.code, reference=reference
        ) from exc


def _is_image_archive(path: Path) -> bool:
    """A ``docker save`` tarball (manifest.json) or an OCI layout tarball (oci-layout)."""
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if member.name.lstrip("./") in ("manifest.json", "oci-layout"):
                    return True
    except (OSError, tarfile.TarError):
        return False
    return False


ISOLATED = "netns+bwrap"
UNISOLATED = "none"


class LocalBackend:
    name = "local"
    # Sandboxes can start before a tenant claims them: the tenant id is only metadata
    # here (meta.json), every resource is named after the sandbox id.
    supports_warm_pool = True

    def __init__(self, config: LocalBackendConfig) -> None:
        check_instance(config.instance)
        self.config = config
        self.names = Names(config.instance)
        if config.isolation not in ISOLATION_MODES:
            raise BackendError(f"isolation must be one of {ISOLATION_MODES}")
        root = os.geteuid() == 0
        if config.isolation == "netns" and not root:
            raise BackendError("isolation='netns' needs root")
        self.isolated = config.isolation == "netns" or (config.isolation == "auto" and root)
        bwrap = shutil.which("bwrap", path=SYSTEM_PATH)
        if self.isolated and bwrap is None:
            raise BackendError("bubblewrap (bwrap) is not installed")
        self.bwrap = bwrap or "bwrap"
        if config.agent_launch not in AGENT_LAUNCH_MODES:
            raise BackendError(f"agent_launch must be one of {AGENT_LAUNCH_MODES}")
        if config.agent_launch == "zygote" and not self.isolated:
            raise BackendError("agent_launch='zygote' needs the netns+bwrap isolation")
        # zygote launch is decided on first use (building pause needs gcc); None: not yet
        self._pause: Path | None = None
        self._zygote_off = not self.isolated or config.agent_launch == "exec"

        # Machine-wide, outside the state dir: what sandboxes bind (pause, exec launch's
        # agent sources) shows its source path in their mountinfo, and the zygote's
        # argv is every agent's cmdline.
        self.runtime_dir = config.claims_dir.parent
        self.zygote = ZygoteClient(
            config.state_dir, config.podagent_dir, self.runtime_dir, config.zygote_python
        )
        self.agent_start_timeout = 10.0  # zygote launch: bwrap's setup until pause is ready
        self.sandboxes_dir = config.state_dir / "sandboxes"
        self.images_dir = config.state_dir / "images"
        self.locks_dir = config.state_dir / "locks"
        for d in (self.sandboxes_dir, self.images_dir, self.locks_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.network = Network(config, self.names)
        self.cgroups = (
            CgroupDriver(self.names.cgroup_group, config.state_dir / "cgroups")
            if root
            else CgroupDriver.disabled()
        )
        # Isolated sandboxes write only to the instance's bounded storage (a quota per
        # sandbox); unisolated ones (dev, non-root) to plain host dirs, unbounded.
        self.storage = (
            Storage(config.state_dir, config.disk_size_mib << 20) if self.isolated else None
        )
        self.node = socket.gethostname()
        # Test seam: called at named points of provision ("netns_created", …) so a
        # test can simulate a provision that dies halfway.
        self.fault_hook: Callable[[str], None] | None = None
        self._gone_reported: set[tuple[str, int | None]] = set()
        self._resolver_restart_at = 0.0  # supervise_resolver: last attempt (monotonic)
        self.resolver_restarts = 0
        self._uid_blocks_claimed = False
        self._store: ImageStore | None = None  # made on first use (needs skopeo)
        # (reference, credentials key) -> (info, expiry): a create re-proves access to
        # an image at most every RESOLVE_CACHE_S per credentials, not per request
        self._resolved: dict[tuple[str, str], tuple[ImageInfo, float]] = {}
        # (reference, credentials key) -> the resolve in flight: concurrent creates of
        # one image with one login wait on one registry round trip (single-flight)
        self._resolving: dict[tuple[str, str], Future[ImageInfo]] = {}
        self._resolving_lock = threading.Lock()
        self._roots_shared = False  # roots_dir is a shared mount (checked once)
        self._userns: dict[int, int] = {}  # uid base -> user namespace fd (idmaps)

    # ---- images ----------------------------------------------------------------------

    def images(self) -> list[ImageInfo]:
        found = [ImageInfo(HOST_IMAGE, "the host's /usr, read-only")]
        for d in sorted(self.images_dir.iterdir()):
            if (d / "rootfs").is_dir() and not d.name.startswith("."):
                digest = (d / "digest").read_text().strip() if (d / "digest").exists() else ""
                found.append(ImageInfo(d.name, "imported root filesystem", digest))
        if self.config.image_store.is_dir():
            found += [self._info(rec) for rec in self._image_store().records()]
        return found

    def import_image(self, name: str, tarball: Path) -> ImageInfo:
        """An OCI layout (a directory) or a ``docker save`` tarball goes to the image
        store under reference ``name``; a ``docker export`` tarball (a flat root
        filesystem) is unpacked as legacy image ``name`` (replacing it)."""
        if tarball.is_dir() or _is_image_archive(tarball):
            with _typed_image_errors(name):
                return self._info(self._image_store().import_archive(tarball, name))
        check_image_name(name)
        if name == HOST_IMAGE:
            raise BackendError("'host' is reserved")
        h = hashlib.sha256()
        with open(tarball, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        staging = self.images_dir / f".{name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "rootfs").mkdir(parents=True)
        try:
            run(
                [
                    "tar",
                    "-x",
                    "--numeric-owner",
                    "-f",
                    str(tarball),
                    "-C",
                    str(staging / "rootfs"),
                    "--exclude=./dev/*",
                    "--exclude=dev/*",
                ],
                timeout=600,
            )
            (staging / "digest").write_text(f"sha256:{h.hexdigest()}\n")
            final = self.images_dir / name
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return ImageInfo(name, "imported root filesystem", f"sha256:{h.hexdigest()}")

    def _base_args(self, image: str) -> tuple[list[str], str]:
        """bwrap's root filesystem arguments and the python that runs an exec-started
        agent ("" with the zygote: its agents run the control plane's interpreter)."""
        if image == HOST_IMAGE:
            return process.host_base_args(), self.config.python
        check_image_name(image)
        rootfs = self.images_dir / image / "rootfs"
        if not rootfs.is_dir():
            raise UnknownImage(f"unknown image {image!r}")
        if self._zygote_pause() is not None:
            return process.rootfs_base_args(rootfs), ""
        for python in ("usr/bin/python3", "usr/local/bin/python3"):
            if (rootfs / python).exists() or (rootfs / python).is_symlink():
                return process.rootfs_base_args(rootfs), "/" + python
        if self.config.agent_bundle is not None:
            return process.rootfs_base_args(rootfs), process.BUNDLED_PYTHON
        raise UnknownImage(f"image {image!r} has no python3 and no agent bundle is configured")

    def _zygote_pause(self) -> Path | None:
        """The pause binary when agents start from the zygote, None for exec launch."""
        if self._pause is None and not self._zygote_off:
            try:
                self._pause = build_pause(self.runtime_dir / "bin")
            except ZygoteUnavailable as exc:
                if self.config.agent_launch == "zygote":
                    raise
                log.warning("agent zygote unavailable, agents start by exec: %s", exc)
                self._zygote_off = True
        return self._pause

    def _check_launch_protected(self) -> None:
        """Refuse, before anything is made, a sandbox whose agent would start by exec
        launch (isolated, no zygote): there a command can kill or renice its agent,
        turning its own failing episode into an ``environment`` one. Opt-in:
        ``allow_unprotected_exec_launch``."""
        if (
            self.isolated
            and self._zygote_pause() is None
            and not self.config.allow_unprotected_exec_launch
        ):
            raise UnprotectedLaunch(
                "agents here start by exec launch (agent_launch="
                f"{self.config.agent_launch!r}; the zygote is unavailable or off), where "
                "a command can kill or renice the agent; build the zygote's pause (gcc) "
                "or set HEDGEROW_LOCAL_ALLOW_UNPROTECTED_EXEC_LAUNCH=1 for single-tenant use"
            )

    @property
    def agent_launch(self) -> str:
        """ "zygote" or "exec": how this backend starts isolated agents now."""
        return "zygote" if self._zygote_pause() is not None else "exec"

    # ---- paths and meta --------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def _meta(self, sandbox_id: str) -> dict[str, Any] | None:
        return read_json(self._dir(sandbox_id) / "meta.json")

    def _save_meta(self, sandbox_id: str, meta: dict[str, Any]) -> None:
        # Not fsynced: meta.json describes a netns, cgroups and processes that a
        # machine crash destroys too. After one, a torn or empty meta.json reads as
        # "no meta" and destroy works from the names alone, as it must anyway.
        write_atomic(self._dir(sandbox_id) / "meta.json", json.dumps(meta, indent=1), durable=False)

    def _lock(self, sandbox_id: str) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.locks_dir / f"{sandbox_id}.lock")

    def _hook(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point)

    @staticmethod
    def _alive(meta: dict[str, Any] | None) -> bool:
        """The sandbox's recorded pid and, where known, its agent are alive: an orphan
        can keep bwrap's init (the recorded pid) alive after the agent died, and such a
        sandbox can answer nothing."""
        if not meta or not is_alive(meta.get("pid"), meta.get("start_time")):
            return False
        if meta.get("agent_pid") and meta.get("agent_start_time") is not None:
            return is_alive(meta["agent_pid"], meta["agent_start_time"])
        return True

    @staticmethod
    def _endpoint_of(meta: dict[str, Any]) -> Endpoint:
        return Endpoint(
            meta["ip"],
            int(meta["port"]),
            meta["isolation"],
            meta.get("node", ""),
            meta.get("image_digest", ""),
        )

    # ---- lifecycle -------------------------------------------------------------------

    # OCI images (images/, docs/images.md). "host" and the legacy `docker export`
    # imports keep their names; anything else is an OCI reference and goes through the
    # machine-wide store. No name ever falls back to another image.

    def _is_legacy(self, image: str) -> bool:
        if image == HOST_IMAGE:
            return True
        try:
            check_image_name(image)
        except BackendError:
            return False
        return (self.images_dir / image / "rootfs").is_dir()

    def _image_store(self) -> ImageStore:
        if self._store is None:
            self._store = ImageStore(
                self.config.image_store,
                policy=self.config.registry_policy,
                min_free_bytes=self.config.image_min_free_bytes,
                skopeo=Skopeo(
                    allow_unprotected_loopback=self.config.registry_allow_unprotected_loopback
                ),
            )
        return self._store

    @staticmethod
    def _credentials(credentials: RegistryCredentials | None) -> Credentials | None:
        if credentials is None:
            return None
        return Credentials(credentials.username, credentials.password)

    @staticmethod
    def _info(rec: ImageRecord) -> ImageInfo:
        return ImageInfo(rec.reference, "OCI image", rec.digest, rec.unpacked_size, len(rec.layers))

    def resolve_image(
        self, reference: str, credentials: RegistryCredentials | None = None
    ) -> ImageInfo:
        if self._is_legacy(reference):
            return next(i for i in self.images() if i.name == reference)
        key = (reference, _credential_key(credentials))
        hit = self._fresh_proof(key)
        if hit is not None:
            return hit
        with self._resolving_lock:
            hit = self._fresh_proof(key)  # a resolve that just ended
            if hit is not None:
                return hit
            flight = self._resolving.get(key)
            leader = flight is None
            if flight is None:
                flight = self._resolving[key] = Future()
        if not leader:
            return flight.result()  # the leader's answer, or its typed error
        try:
            info = self._resolve_uncached(reference, credentials)
        except BaseException as exc:
            flight.set_exception(exc)
            raise
        else:
            self._resolved[key] = (info, time.monotonic() + RESOLVE_CACHE_S)
            flight.set_result(info)
            return info
        finally:
            with self._resolving_lock:
                del self._resolving[key]

    def _fresh_proof(self, key: tuple[str, str]) -> ImageInfo | None:
        """The cached answer for (reference, credentials key), if still within its
        RESOLVE_CACHE_S window: these credentials proved access to that digest."""
        hit = self._resolved.get(key)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        return None

    def _resolve_uncached(
        self, reference: str, credentials: RegistryCredentials | None
    ) -> ImageInfo:
        store = self._image_store()
        with _typed_image_errors(reference):
            digest = store.resolve(reference, credentials=self._credentials(credentials))
            rec = store.get(digest)
        if rec is not None:
            return self._info(rec)
        return ImageInfo(str(image_ref.parse(reference)), "OCI image (not pulled)", digest)

    def pull_image(
        self,
        reference: str,
        credentials: RegistryCredentials | None = None,
        progress: ProgressCallback | None = None,
    ) -> ImageInfo:
        if self._is_legacy(reference):
            return self.resolve_image(reference)
        with _typed_image_errors(reference):
            rec = self._image_store().pull(
                reference, credentials=self._credentials(credentials), progress=progress
            )
        info = self._info(rec)
        self._resolved[(reference, _credential_key(credentials))] = (
            info,
            time.monotonic() + RESOLVE_CACHE_S,
        )
        return info

    def remove_image(self, digest: str) -> bool:
        with _typed_image_errors(digest):
            removed = self._image_store().remove(digest)
        if removed:
            self._resolved = {k: v for k, v in self._resolved.items() if v[0].digest != digest}
        return removed

    def collect_images(self) -> list[str]:
        """LRU collection down to the cache cap (no cap: only what no image uses)."""
        cap = self.config.image_cache_bytes or (1 << 62)
        return self._image_store().collect(cap)

    def prepare(self) -> None:
        """The instance's share of the first provision, done before any create: the
        sandbox storage mounted, the static pause and exec helper built (gcc), the
        bridge and host tables, the uid blocks claimed, the agent zygote started. A
        burst on a fresh instance otherwise pays these inside its first provisions, one
        per worker process at once (2.5-3.2 s each against a p50 of 0.34 s,
        docs/benchmarks.md). In a provision's order: the
        storage is mounted and the roots dir shared before the zygote starts (one that
        started before would be stopped by the next provision: its mount table is old)."""
        if self.storage is not None:
            if self.storage.ensure():
                self.zygote.stop()
            self._ensure_roots_shared()
        if self.isolated:
            with file_lock(self.locks_dir / "instance.lock"):
                self._instance_claim()
        if self._zygote_pause() is not None:
            self.zygote.ensure()

    def _instance_claim(self) -> None:
        """The instance's bridge and tables, and its user-id blocks claimed once per
        process; the caller holds ``instance.lock`` (``prepare`` and ``provision``)."""
        self.network.ensure_instance()
        if not self._uid_blocks_claimed:
            _check_traversable(self.config.state_dir)
            owner = f"{self.config.instance} {self.config.state_dir}"
            idmap.claim_blocks(self.config.claims_dir, self.network.subnet, owner)
            self._uid_blocks_claimed = True

    def provision(self, spec: SandboxSpec, progress: ProgressCallback | None = None) -> Endpoint:
        check_sandbox_id(spec.sandbox_id)
        self._check_launch_protected()
        if spec.snapshot_id:
            manifest = self._snapshot_manifest(spec.snapshot_id)
            if manifest["image"] != spec.image:
                raise BackendError(
                    f"snapshot {spec.snapshot_id} is of image {manifest['image']!r}, "
                    f"not {spec.image!r}"
                )
        if self._is_legacy(spec.image):
            base_args, python = self._base_args(spec.image)
            launch: _Launch | None = _Launch(base_args, python)
        else:
            with _typed_image_errors(spec.image):
                image_ref.parse(spec.image)  # a bad reference: nothing made at all
            if not self.isolated:
                raise BackendError(
                    f"image {spec.image!r}: OCI images need the netns+bwrap isolation (root)"
                )
            launch = None  # pulled and mounted inside, where a failure rolls back
        with self._lock(spec.sandbox_id):
            meta = self._meta(spec.sandbox_id)
            if (
                meta is not None
                and meta.get("generation") == spec.generation
                and meta.get("state") == "started"
                and self._alive(meta)
            ):
                return self._endpoint_of(meta)  # adopt: same generation, still running
            if meta or self._dir(spec.sandbox_id).exists():
                self._destroy_locked(spec.sandbox_id)
            try:
                return self._provision_locked(spec, launch, progress)
            except Exception as exc:
                try:
                    self._destroy_locked(spec.sandbox_id)
                except Exception as cleanup_exc:  # noqa: BLE001 - report both
                    raise BackendError(
                        f"provision failed ({exc}); rollback failed too: {cleanup_exc}"
                    ) from exc
                if isinstance(exc, BackendError):
                    raise
                raise BackendError(f"provision failed: {exc}") from exc

    def _provision_locked(
        self, spec: SandboxSpec, launch: _Launch | None, progress: ProgressCallback | None
    ) -> Endpoint:
        sid = spec.sandbox_id
        d = self._dir(sid)
        image: ImageRecord | None = None
        if launch is None:
            # leased to this sandbox before the pull returns: collection cannot take
            # it before the mount; destroy releases the lease by the sandbox id
            if spec.snapshot_id:
                image = self._lease_snapshot_image(spec)
            else:
                image = self._pull_leased(spec, progress)
            self._hook("image_pulled")
        volume = self._make_dirs(sid, spec.disk_mib << 20, spec.snapshot_id)
        meta: dict[str, Any] = {
            "sandbox_id": sid,
            "tenant_id": spec.tenant_id,
            "generation": spec.generation,
            "image": spec.image,
            "image_digest": image.digest if image is not None else "",
            "state": "provisioning",
            "isolation": ISOLATED if self.isolated else UNISOLATED,
            "node": self.node,
            "network_access": spec.network_access,
            "egress": spec.egress_policy.to_json(),
            "labels": spec.labels,
            "created_at": time.time(),
        }
        if volume is not None:
            meta["disk"] = {"qgroup": volume.qgroup, "limit_bytes": volume.limit_bytes}
        limits = Limits(spec.memory_mib * 1024 * 1024, spec.cpu_millis, spec.pids_limit)
        resolv_conf: Path | None = None
        if self.isolated:
            with file_lock(self.locks_dir / "instance.lock"):
                self._instance_claim()
                # Host sandboxes always name the instance's resolver (a live policy
                # change can then give one DNS); image sandboxes keep their own
                # resolv.conf unless made with an allowlist.
                # (a legacy imported root is read-only: bwrap can bind over its
                # /etc/resolv.conf only where the file exists)
                bindable = (
                    image is not None
                    or spec.image == HOST_IMAGE
                    or os.path.lexists(self.images_dir / spec.image / "rootfs/etc/resolv.conf")
                )
                if bindable and (image is None or spec.egress_policy.mode == "allow"):
                    resolv_conf = self._resolv_conf()
                if spec.egress_policy.routed:
                    self._ensure_resolver(required=spec.egress_policy.mode == "allow")
            ip = self.network.claim_ip(sid)
            meta.update(
                resolver_dns=resolv_conf is not None,
                uid_base=idmap.uid_base(ip),
                ip=ip,
                port=self.config.agent_port,
                netns=self.names.netns(sid),
                host_veth=self.names.host_veth(sid),
                bridge=self.network.bridge_of(ip),
            )
        else:
            meta.update(ip="127.0.0.1", port=_free_port())
        # One write records everything destroy needs before any of it exists: the
        # address (its egress element must go before the address is reused) and the
        # cgroup dirs (another process of the instance may sit in other cgroups).
        # A crash before it leaves a dir without meta and maybe a claim: destroy
        # then reads every claim. The other write is the final "started".
        meta["cgroups"] = {c: str(p) for c, p in self.cgroups.paths(sid).items()}
        self._save_meta(sid, meta)
        if self.isolated:
            self.network.create(sid, ip, spec.egress_policy, self._hook)
        created = self.cgroups.create(sid, limits)
        # the agent's own groups (memory and pids split from its commands': cgroups.py)
        cgroup_dirs = {str(p): p for p in self.cgroups.agent_dirs(created)}
        cgroup_files = self.cgroups.agent_files(created)
        if self.storage is not None:  # the agent names a full disk from its quota group
            cgroup_files.update(self.storage.quota_files(sid))
        self._hook("cgroups_created")
        if spec.snapshot_id:
            assert volume is not None  # snapshots need the storage (_make_dirs checks)
            self._verify_restore(spec.snapshot_id, volume, int(meta["uid_base"]))
            self._hook("restored")
        if self.isolated:
            # sandbox root (host id uid_base) owns what it may write
            idmap.chown_tree_top(list(self._data_dirs(sid)), int(meta["uid_base"]))
        else:
            process.write_token(d / "secret", spec.agent_token)
        pause = self._zygote_pause() if self.isolated else None
        if image is not None:
            assert volume is not None  # OCI images need isolation (provision checks)
            launch = self._mount_image_root(sid, volume, image, int(meta["uid_base"]), pause)
            self._hook("root_mounted")
        assert launch is not None
        launch.resolv_conf = resolv_conf
        if pause is not None:
            meta.update(
                self._spawn_from_zygote(spec, d, launch, pause, cgroup_dirs, cgroup_files, meta)
            )
        elif self.isolated:
            pid, start = self._launch_exec(spec, d, launch, cgroup_dirs, cgroup_files, meta)
            meta.update(pid=pid, start_time=start, launch="exec")
            meta.update(process.find_exec_agent(pid, start, self.agent_start_timeout))
        else:
            pid, start = self._launch_unisolated(
                spec, d, int(meta["port"]), limits, list(cgroup_dirs.values()), cgroup_files
            )
            meta.update(pid=pid, start_time=start, launch="exec")
        meta.update(state="started")
        self._save_meta(sid, meta)
        self._hook("started")
        return self._endpoint_of(meta)

    # ---- OCI image roots (docs/images.md "Sandbox roots") ------------------------------

    def _pull_leased(self, spec: SandboxSpec, progress: ProgressCallback | None) -> ImageRecord:
        """The sandbox's image, leased to it. A warm create asks no registry: when
        these credentials proved access to the reference within RESOLVE_CACHE_S in
        this process (a resolve_image, a pull or an earlier provision) and the store
        holds that digest complete,
        the lease is taken from the store alone. Otherwise a pull, which asks the
        registry with these credentials (and fetches what is missing)."""
        holder = lease_holder(self.config.instance, spec.sandbox_id)
        store = self._image_store()
        proof = self._fresh_proof((spec.image, _credential_key(spec.registry_credentials)))
        if proof is not None and proof.digest:
            with _typed_image_errors(spec.image):
                stored = store.lease_stored(proof.digest, holder)
            if stored is not None:
                if progress is not None:
                    progress({"phase": "resolved", "digest": stored.digest})
                    progress({"phase": "done", "digest": stored.digest})
                return stored
        with _typed_image_errors(spec.image):
            rec = store.pull(
                spec.image,
                credentials=self._credentials(spec.registry_credentials),
                progress=progress,
                lease=holder,
            )
        self._resolved[(spec.image, _credential_key(spec.registry_credentials))] = (
            self._info(rec),
            time.monotonic() + RESOLVE_CACHE_S,
        )
        return rec

    @property
    def roots_dir(self) -> Path:
        """Where image sandboxes' roots are mounted, ``<roots_dir>/<sandbox id>``: a
        shared mount, so roots mounted after the zygote started reach its launcher
        mount namespace (an rslave copy of this one, whose / is private)."""
        return self.config.state_dir / "roots"

    def _root_target(self, sid: str) -> Path:
        return self.roots_dir / sid

    def _ensure_roots_shared(self) -> None:
        """Makes ``roots_dir`` a shared bind mount of itself, once per machine boot;
        a zygote started before then is stopped (its launcher namespace was copied
        without it, so no root mounted later could reach its bwraps)."""
        if self._roots_shared:
            return
        with file_lock(self.locks_dir / "roots.lock"):
            if not _is_shared_mount(self.roots_dir):
                self.roots_dir.mkdir(mode=0o711, exist_ok=True)
                os.chmod(self.roots_dir, 0o711)  # noqa: S103 - bwrap (a sandbox's id) binds from here
                target = os.fsencode(self.roots_dir)
                if _libc.mount(target, target, None, MS_BIND, None) != 0:
                    err = ctypes.get_errno()
                    raise BackendError(f"cannot bind-mount {self.roots_dir}: {os.strerror(err)}")
                if _libc.mount(None, target, None, MS_SHARED, None) != 0:
                    err = ctypes.get_errno()
                    _libc.umount2(target, image_overlay.MNT_DETACH)
                    raise BackendError(f"cannot make {self.roots_dir} shared: {os.strerror(err)}")
                self.zygote.stop()
        self._roots_shared = True

    def _userns_of(self, uid_base: int) -> int:
        """A user namespace fd with the sandbox's id maps, for idmapping its layers
        (the mount keeps only the mapping): one per uid base, kept (~4 ms each)."""
        fd = self._userns.get(uid_base)
        if fd is None:
            fd = idmap.userns_fd(uid_base)
            os.set_inheritable(fd, False)
            self._userns[uid_base] = fd
        return fd

    def _mount_image_root(
        self, sid: str, volume: Volume, rec: ImageRecord, uid_base: int, pause: Path | None
    ) -> _Launch:
        """The sandbox's root: the image's layers (idmapped to its ids) under a
        writable upper dir inside its volume (its ``disk`` quota covers the root's
        writes), mounted at ``<roots_dir>/<sid>``."""
        store = self._image_store()
        lower = store.lower_dirs(rec)
        with _typed_image_errors(rec.reference):
            uid, gid = image_user.resolve_user(rec.reference, lower, rec.config.user)
            if max(uid, gid) >= USERNS_RANGE:  # another sandbox's host ids: never
                raise image_user.ImageUserUnknown(
                    rec.reference, f"User {rec.config.user!r} is outside ids 0..{USERNS_RANGE - 1}"
                )
        self._ensure_roots_shared()
        if (uid, gid) != (0, 0):
            # the image's user runs the commands: /workspace is theirs to write
            os.chown(volume.workspace, uid_base + uid, uid_base + gid)
        upper, work = volume.root / "root" / "upper", volume.root / "root" / "work"
        for path in (upper.parent, upper, work):
            path.mkdir(mode=0o755, exist_ok=True)  # a restore brings them
            os.chown(path, uid_base, uid_base)  # the sandbox's root owns its /
        target = self._root_target(sid)
        target.mkdir(mode=0o755, exist_ok=True)
        try:
            image_overlay.mount_rootfs(lower, upper, work, target, self._userns_of(uid_base))
        except OSError as exc:
            raise BackendError(f"cannot mount {sid}'s root from {rec.reference}: {exc}") from exc
        python = ""
        if pause is None:  # exec launch: the agent runs on the image's python or the bundle
            python = self._image_python(target)
        return _Launch(
            [],
            python,
            root=target,
            env=image_env(rec.config.env),
            workdir=image_workdir(rec.config.working_dir),
            digest=rec.digest,
            user=(uid, gid) if (uid, gid) != (0, 0) else None,
            caps=tuple(process.IMAGE_CAPABILITIES),
        )

    def _image_python(self, root: Path) -> str:
        for python in ("usr/bin/python3", "usr/local/bin/python3"):
            if os.path.lexists(root / python):
                return "/" + python
        if self.config.agent_bundle is not None:
            return process.BUNDLED_PYTHON
        raise BackendError("the image has no python3 and no agent bundle is configured")

    def _release_image_root(self, sid: str) -> None:
        """Unmounts the sandbox's root (lazily if something still holds it) and drops
        its image lease. Idempotent; works from the sandbox id alone."""
        target = self._root_target(sid)
        path = os.fsencode(target)
        while _libc.umount2(path, 0) == 0:
            pass  # stacked mounts: one umount each
        err = ctypes.get_errno()
        if err == errno.EBUSY:
            if _libc.umount2(path, image_overlay.MNT_DETACH) != 0:
                err = ctypes.get_errno()
                raise BackendError(f"cannot unmount {target}: {os.strerror(err)}")
        elif err not in (errno.EINVAL, errno.ENOENT):
            raise BackendError(f"cannot unmount {target}: {os.strerror(err)}")
        with contextlib.suppress(FileNotFoundError):
            target.rmdir()
        if self.config.image_store.is_dir():
            self._image_store().release(lease_holder(self.config.instance, sid))

    def _make_dirs(self, sid: str, disk_bytes: int, snapshot_id: str = "") -> Volume | None:
        """Every directory a sandbox gets, made in one place: its state dir (meta,
        token, agent.log) on the host, its writable data (/workspace, /tmp) on the
        storage in a volume limited to ``disk_bytes`` (isolated), or host dirs."""
        d = self._dir(sid)
        d.mkdir(parents=True, exist_ok=True)
        if self.storage is None:
            if snapshot_id:
                raise BackendError("snapshots need the netns+bwrap isolation's storage (root)")
            for sub in ("workspace", "tmp"):
                (d / sub).mkdir(exist_ok=True)
            os.chmod(d / "tmp", 0o1777)  # noqa: S103 - a /tmp must be world-writable + sticky
            return None
        if self.storage.ensure():
            # A zygote started before the storage was mounted has a copy of the old
            # mount table (the host's / is private): its bwraps could not bind from it.
            self.zygote.stop()
        # before any zygote starts: image roots mounted later must reach its bwraps
        self._ensure_roots_shared()
        if snapshot_id:
            return self.storage.restore(sid, disk_bytes, self.storage.snapshots_dir / snapshot_id)
        return self.storage.create(sid, disk_bytes)

    def _data_dirs(self, sid: str) -> tuple[Path, Path]:
        """The host paths of the sandbox's /workspace and /tmp."""
        if self.storage is None:
            return self._dir(sid) / "workspace", self._dir(sid) / "tmp"
        root = self.storage.mount / sid
        return root / "workspace", root / "tmp"

    def _bwrap_argv(
        self,
        d: Path,
        launch: _Launch,
        *,
        python: str,
        bundle: Path | None = None,
        pause: Path | None = None,
        cgroup_fds: dict[str, list[int]] | None = None,
        seccomp_fd: int = SECCOMP_FD,
        token_fd: int = TOKEN_FD,
    ) -> list[str]:
        """bwrap's command line for the sandbox whose directory is ``d``; the two launch
        modes differ only in ``python``/``bundle`` (exec) or ``pause`` (zygote)."""
        workspace, tmp = self._data_dirs(d.name)
        base_args = launch.base_args
        if launch.resolv_conf is not None:  # over the host's or the image's own
            base_args = [*base_args, "--ro-bind", str(launch.resolv_conf), "/etc/resolv.conf"]
        return process.bwrap_argv(
            base_args=base_args,
            root=launch.root,
            env=launch.env,
            workdir=launch.workdir,
            caps=launch.caps if pause is None else (),
            user=launch.user,
            workspace=workspace,
            tmp=tmp,
            token_fd=token_fd,
            podagent_dir=self._published_podagent() if pause is None else self.config.podagent_dir,
            python=python,
            port=self.config.agent_port,
            seccomp_fd=seccomp_fd,
            agent_bundle=bundle,
            pause=pause,
            cgroup_fds=cgroup_fds,
        )

    def _published_podagent(self) -> Path:
        return process.publish_podagent(
            self.config.podagent_dir, self.runtime_dir, self.zygote.version
        )

    def _launch_exec(
        self,
        spec: SandboxSpec,
        d: Path,
        launch: _Launch,
        cgroup_dirs: dict[str, Path],
        cgroup_files: dict[str, list[str]],
        meta: dict[str, Any],
    ) -> tuple[int, int]:
        """Exec launch: ``ip netns exec`` (host root joins the netns), ``nsenter`` into
        the sandbox's user namespace as its root, then bwrap with its options by
        --args and the seccomp program by --seccomp (both memfds)."""
        fds: list[int] = []
        with process.cgroup_fds(cgroup_files) as limit_fds:
            try:
                fds.append(seccomp.memfd(seccomp.program()))
                fds.append(process.data_memfd("token", spec.agent_token.encode()))
                argv = self._bwrap_argv(
                    d,
                    launch,
                    python=launch.python,
                    bundle=self.config.agent_bundle,
                    cgroup_fds=limit_fds,
                    seccomp_fd=fds[0],
                    token_fd=fds[1],
                )
                options, payload = process.split(argv)
                fds.append(process.args_memfd(options))
                fds.append(idmap.userns_fd(int(meta["uid_base"])))
                args, userns = fds[2], fds[3]
                chain = [
                    *("ip", "netns", "exec", self.names.netns(spec.sandbox_id)),
                    *("nsenter", f"--user=/proc/self/fd/{userns}", "--"),
                    # the user namespace's fd must not reach the sandbox (bash: dash's
                    # redirections take one-digit fds only)
                    *("/bin/bash", "-c", f'exec {userns}<&- "$@"', "hedgerow-userns"),
                    *(self.bwrap, "--args", str(args), "--", *payload),
                ]
                return process.launch_detached(
                    chain,
                    cgroup_dirs=list(cgroup_dirs.values()),
                    log_file=d / "agent.log",
                    pass_fds=[*fds, *(fd for group in limit_fds.values() for fd in group)],
                    # the shells export PWD, which bwrap's init keeps: not the caller's
                    # directory (a host path) but /
                    cwd=Path("/"),
                )
            finally:
                for fd in fds:
                    os.close(fd)

    def _spawn_from_zygote(
        self,
        spec: SandboxSpec,
        d: Path,
        launch: _Launch,
        pause: Path,
        cgroup_dirs: dict[str, Path],
        cgroup_files: dict[str, list[str]],
        meta: dict[str, Any],
    ) -> dict[str, Any]:
        options, payload = process.split(self._bwrap_argv(d, launch, python="", pause=pause))
        timeout = self.agent_start_timeout
        answer = self.zygote.spawn(
            {
                "bwrap": self.bwrap,
                "bwrap_args": options,
                "payload": payload,
                "uid_base": int(meta["uid_base"]),
                "pause": str(pause),  # also the user namespace's helper (pause.c)
                # over the zygote's 0600 socket; bwrap copies it into the sandbox's
                # tmpfs (--file): it is never on the host's disk
                "token": spec.agent_token,
                "bwrap_env": {"PATH": SYSTEM_PATH},
                "netns": str(NETNS_DIR / self.names.netns(spec.sandbox_id)),
                "cgroups": [str(p) for p in cgroup_dirs.values()],
                "cgroup_files": cgroup_files,
                "log": str(d / "agent.log"),
                "workdir": "/workspace",
                "env": launch.env,
                "agent_args": process.agent_args(
                    self.config.agent_port, launch.workdir, launch.user, EXEC_HELPER_MOUNT
                ),
                # kept by the agent for root's commands (none for host sandboxes)
                "caps": [process.IMAGE_CAPABILITIES[c] for c in launch.caps],
                # the handler hides every other image sandbox's root from bwrap
                "roots_dir": str(self.roots_dir),
                "root": str(launch.root) if launch.root is not None else "",
                "umask": _own_umask(),
                "timeout": timeout,
            },
            timeout=timeout + 15,
        )
        if not answer.get("ok"):
            raise BackendError(
                f"agent start failed: {answer.get('error')}; "
                f"agent.log: {process.tail(d / 'agent.log')}"
            )
        init_pid, init_start = int(answer["init_pid"]), answer.get("init_start_time")
        if init_start is None or not is_alive(init_pid, init_start):
            raise BackendError(f"agent exited at once: {process.tail(d / 'agent.log')}")
        # The sandbox's pid 1 (pause, bwrap --as-pid-1) is the recorded pid: SIGKILL kills
        # everything in the sandbox, and it exits when the agent dies (pause sees EOF).
        return {
            "pid": init_pid,
            "start_time": init_start,
            "bwrap_pid": answer["bwrap_pid"],
            "bwrap_start_time": answer.get("bwrap_start_time"),
            "agent_pid": answer["agent_pid"],
            # the agent is watched itself (_alive): an orphan keeps the init alive
            "agent_start_time": proc_start_time(int(answer["agent_pid"])),
            "launch": "zygote",
        }

    def _launch_unisolated(
        self,
        spec: SandboxSpec,
        d: Path,
        port: int,
        limits: Limits,
        cgroup_dirs: list[Path],
        cgroup_files: dict[str, list[str]],
    ) -> tuple[int, int]:
        argv = [
            self.config.python,
            "-m",
            "podagent",
            "--listen",
            f"127.0.0.1:{port}",
            "--token-file",
            str(d / "secret" / "token"),
            "--unlink-token",
            "--workdir",
            str(d / "workspace"),
        ]
        if not cgroup_dirs and shutil.which("prlimit", path=SYSTEM_PATH):
            # no cgroups: address-space rlimit as the memory guard (RLIMIT_NPROC
            # is per-uid, so it would count the whole user's processes: not used)
            argv = ["prlimit", f"--as={max(limits.memory_bytes, 256 << 20) * 4}", "--", *argv]
        env = {
            "PATH": SYSTEM_PATH,
            "HOME": str(d / "workspace"),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(self.config.podagent_dir.resolve().parent),
            "HEDGEROW_AGENT_ENV_RESTORE": process.AGENT_ENV_RESTORE,
        }
        with process.cgroup_fds(cgroup_files if cgroup_dirs else {}) as fds:
            if fds:
                argv += ["--cgroup-fds", process.format_fds(fds)]
            return process.launch_detached(
                argv,
                cgroup_dirs=cgroup_dirs,
                log_file=d / "agent.log",
                env=env,
                cwd=d / "workspace",
                pass_fds=[fd for group in fds.values() for fd in group],
            )

    # ---- snapshots (snapshots.py, docs/snapshots.md) -----------------------------------

    def _snapshot_manifest_path(self, snapshot_id: str) -> Path:
        check_sandbox_id(snapshot_id)  # same form as a sandbox id: 32 hex digits
        if self.storage is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id}: this backend keeps none")
        return self.storage.snapshots_dir / f"{snapshot_id}.json"

    def _snapshot_manifest(self, snapshot_id: str) -> dict[str, Any]:
        """The snapshot's manifest (written last by ``snapshot``: one exists only
        complete). Raises SnapshotNotFound."""
        path = self._snapshot_manifest_path(snapshot_id)
        if self.storage is not None:
            self.storage.ensure()
        manifest = read_json(path)
        if manifest is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")
        return manifest

    def _snapshot_lock(self, snapshot_id: str) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.locks_dir / f"snapshot-{snapshot_id}.lock")

    def snapshot(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        check_sandbox_id(sandbox_id)
        manifest_path = self._snapshot_manifest_path(snapshot_id)
        assert self.storage is not None  # _snapshot_manifest_path checks
        storage = self.storage
        holder = snapshot_holder(self.config.instance, snapshot_id)
        with self._lock(sandbox_id), self._snapshot_lock(snapshot_id):
            meta = self._meta(sandbox_id)
            if not meta or meta.get("state") != "started" or not self._alive(meta):
                raise SnapshotFailed(
                    f"sandbox {sandbox_id} is not running", code="sandbox_not_running"
                )
            if manifest_path.exists():
                raise SnapshotFailed(f"snapshot {snapshot_id} exists already")
            freezer = (meta.get("cgroups") or {}).get("freezer")
            if not freezer:
                # no silent capture of a sandbox that keeps writing
                raise SnapshotFailed("this machine has no freezer cgroup: cannot quiesce")
            digest = str(meta.get("image_digest") or "")
            try:
                if digest:
                    with _typed_image_errors(digest):
                        self._image_store().lease(holder, digest)
                storage.flush()  # outside the freeze: see Storage.flush
                started = time.monotonic()
                with self.cgroups.frozen(Path(freezer)):
                    self._hook("snapshot_frozen")
                    path = storage.capture(sandbox_id, snapshot_id)
                capture_s = time.monotonic() - started
                self._hook("snapshot_captured")
                entries = snaps.tree(path, int(meta["uid_base"]))
                info = SnapshotInfo(
                    snapshot_id=snapshot_id,
                    sandbox_id=sandbox_id,
                    image=str(meta.get("image", "")),
                    image_digest=digest,
                    fingerprint=snaps.fingerprint(entries),
                    files=len(entries),
                    size_bytes=snaps.file_bytes(entries),
                    capture_s=capture_s,
                    captured_at=time.time(),
                )
                manifest = {
                    **dataclasses.asdict(info),
                    "uid_base": int(meta["uid_base"]),
                    # read-only and unchanged since it was hashed: a restore need not
                    # read the data again (_verify_restore)
                    "ctransid": storage.snapshot_ctransid(snapshot_id),
                    "entries": entries,
                }
                write_atomic(manifest_path, json.dumps(manifest), mode=0o600)
            except Exception as exc:
                self._drop_snapshot(snapshot_id, holder)
                if isinstance(exc, SnapshotFailed):
                    raise
                raise SnapshotFailed(f"capture of {sandbox_id} failed: {exc}") from exc
        return info

    def _drop_snapshot(self, snapshot_id: str, holder: str) -> None:
        assert self.storage is not None
        with contextlib.suppress(FileNotFoundError):
            (self.storage.snapshots_dir / f"{snapshot_id}.json").unlink()
        self.storage.drop_snapshot(snapshot_id)
        if self.config.image_store.is_dir():
            self._image_store().release(holder)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._snapshot_manifest_path(snapshot_id)
        assert self.storage is not None
        self.storage.ensure()
        with self._snapshot_lock(snapshot_id):
            self._drop_snapshot(snapshot_id, snapshot_holder(self.config.instance, snapshot_id))

    def snapshots(self) -> list[str]:
        """Ids of the complete snapshots this instance keeps."""
        if self.storage is None or not self.storage.mounted():
            return []
        d = self.storage.snapshots_dir
        if not d.is_dir():
            return []
        return sorted(p.stem for p in d.glob("*.json"))

    def _lease_snapshot_image(self, spec: SandboxSpec) -> ImageRecord:
        """The snapshot's exact image (by digest, from the store: its lease keeps it
        there), leased to the restored sandbox."""
        digest = str(self._snapshot_manifest(spec.snapshot_id)["image_digest"])
        with _typed_image_errors(spec.image):
            return self._image_store().lease(
                lease_holder(self.config.instance, spec.sandbox_id), digest
            )

    def _verify_restore(self, snapshot_id: str, volume: Volume, uid_base: int) -> None:
        """The restored volume's owners moved to this sandbox's id range, then its
        tree compared with the snapshot's, before anything runs in it."""
        manifest = self._snapshot_manifest(snapshot_id)
        assert self.storage is not None
        # The new volume is a copy-on-write snapshot of the snapshot, made just now
        # and written by nothing but the owner shift: if the snapshot is unchanged
        # since its capture hashed it (same ctransid), so is every file's data here,
        # and only the metadata of each entry is read (O(files), not O(bytes)). If
        # anything changed the snapshot, every file is hashed again.
        unchanged = self.storage.snapshot_ctransid(snapshot_id) == manifest.get("ctransid")
        snaps.shift_owners(volume.root, int(manifest["uid_base"]), uid_base)
        entries = snaps.tree(volume.root, uid_base, manifest["entries"] if unchanged else None)
        if snaps.fingerprint(entries) != manifest["fingerprint"]:
            diff = snaps.diff(manifest["entries"], entries)
            raise StateDivergence(
                f"restore of snapshot {snapshot_id} differs in {len(diff)} path(s): "
                + ", ".join(d["path"] for d in diff[:5]),
                diff=diff,
            )

    def destroy(self, sandbox_id: str) -> None:
        check_sandbox_id(sandbox_id)
        with self._lock(sandbox_id):
            self._destroy_locked(sandbox_id)

    def _destroy_locked(self, sid: str) -> None:
        meta = self._meta(sid) or {}
        freezer = (meta.get("cgroups") or {}).get("freezer")
        if freezer:
            # frozen first: a fork bomb cannot outrun the kill (cgroups.kill_frozen)
            self.cgroups.kill_frozen(Path(freezer))
        if meta.get("pid"):
            kill_and_wait(int(meta["pid"]), meta.get("start_time"))
        if meta.get("bwrap_pid"):  # zygote launch: exits with the init, or never started it
            kill_and_wait(int(meta["bwrap_pid"]), meta.get("bwrap_start_time"))
        if self.isolated and not (meta.get("state") == "started" and meta.get("cgroups")):
            # A started sandbox's processes are all in its cgroups (the launch joins
            # them before entering the netns), which are emptied below. Otherwise (a
            # provision that died halfway, no usable cgroups) look for anything left
            # in the netns: a scan of every /proc entry, too dear for every destroy.
            kill_pids(self.network.netns_pids(sid))
        cgroup_dirs = set(self.cgroups.paths(sid).values())
        cgroup_dirs |= {Path(p) for p in (meta.get("cgroups") or {}).values()}
        for path in cgroup_dirs:
            self.cgroups.remove(path)
        if self.isolated:
            # no meta: whether it had network access is unknown, so look
            self.network.delete(sid, meta.get("ip"), policy=_meta_policy(meta))
        self.network.release_ips(sid, meta.get("ip") if self.isolated else None)
        # its processes are dead: the root is unused (an image sandbox's upper dir is
        # in its volume, so before the volume goes)
        if self.isolated:  # image roots exist only there (unprivileged umount2 fails)
            self._release_image_root(sid)
        if self.storage is not None:
            self.storage.remove(sid)  # nothing writes any more
        shutil.rmtree(self._dir(sid), ignore_errors=True)
        if self._dir(sid).exists():
            raise BackendError(f"cannot remove {self._dir(sid)}")

    def endpoint(self, sandbox_id: str) -> Endpoint | None:
        check_sandbox_id(sandbox_id)
        meta = self._meta(sandbox_id)
        if meta and meta.get("state") == "started" and self._alive(meta):
            return self._endpoint_of(meta)
        return None

    def metrics(self, sandbox_id: str) -> SandboxMetrics:
        """The live sandbox's counters now, from its cgroups (and its disk quota group
        where storage is bounded). MetricsUnavailable when it runs without cgroups or
        they are gone."""
        check_sandbox_id(sandbox_id)
        meta = self._meta(sandbox_id)
        if not meta or not self._alive(meta):
            raise MetricsUnavailable(f"sandbox {sandbox_id} is not running here")
        created = {c: Path(p) for c, p in (meta.get("cgroups") or {}).items()}
        try:
            memory, cpu_ns, pids, source = self.cgroups.usage(created)
        except (OSError, ValueError) as exc:
            raise MetricsUnavailable(f"no cgroup counters for {sandbox_id}: {exc}") from exc
        disk: int | None = None
        if self.storage is not None:
            used = self.storage.quota_files(sandbox_id).get("disk_used", [])
            with contextlib.suppress(OSError, ValueError):
                disk = int(Path(used[0]).read_text()) if used else None
        return SandboxMetrics(time.time(), memory, cpu_ns, pids, disk, source)

    def _resolv_conf(self) -> Path:
        """``/run/hedgerow/dns/<table>.conf`` naming the gateway (the instance's resolver).

        Not under the state dir: a bind's source path shows in the sandbox's mountinfo
        (as the agent sources, it is kept where it names nothing of the host)."""
        conf = RESOLV_DIR / f"{self.names.nft_table}.conf"
        text = f"nameserver {self.network.gateway}\noptions timeout:2 attempts:2\n"
        try:
            RESOLV_DIR.mkdir(parents=True, exist_ok=True)
            if not conf.exists() or conf.read_text() != text:
                write_atomic(conf, text, 0o644, durable=False)
        except OSError as exc:
            raise BackendError(f"cannot write {conf}: {exc}") from exc
        return conf

    def _ensure_resolver(self, *, required: bool) -> None:
        """The instance's resolver runs on the gateway (caller holds the instance lock).

        ``required``: an allowlist needs it; egress "all" only uses it for DNS, so without
        any upstream to forward to it is not started (DNS then fails at once).
        """
        upstream = self.config.dns_upstream or resolver.system_upstream()
        if not upstream:
            if required:
                raise BackendError("egress allowlists need an upstream DNS server (dns_upstream)")
            return
        try:
            resolver.start(
                self.config.state_dir,
                self.network.gateway,
                upstream,
                self.names.nft_table,
                self.config.dns_grace_s,
                sni_port=SNI_PORT,
            )
        except OSError as exc:
            raise BackendError(f"cannot start the instance's resolver: {exc}") from exc

    def set_egress(self, sandbox_id: str, policy: EgressPolicy) -> None:
        """Changes a running sandbox's egress policy: its netns's table and route when it
        becomes routed or unrouted, its host elements always (the old ones removed first:
        a narrowed policy also cuts established connections the new one does not allow),
        then meta.json (which the resolver reads per query)."""
        check_sandbox_id(sandbox_id)
        if not self.isolated:
            raise BackendError("egress policies need the netns isolation")
        with self._lock(sandbox_id):
            meta = self._meta(sandbox_id)
            if not meta or meta.get("state") != "started" or not meta.get("ip"):
                raise BackendError(f"sandbox {sandbox_id} is not running")
            if policy.mode == "allow" and not meta.get("resolver_dns"):
                raise BackendError(
                    "this sandbox's DNS is its image's own: an allowlist must be given at create"
                )
            old = _meta_policy(meta) or NONE
            if policy.routed:
                with file_lock(self.locks_dir / "instance.lock"):
                    self._ensure_resolver(required=policy.mode == "allow")
            if old.routed != policy.routed:
                self.network.set_routed(sandbox_id, policy.routed)
            self.network.apply_policy(str(meta["ip"]), policy, old)
            meta.update(egress=policy.to_json(), network_access=policy.routed)
            self._save_meta(sandbox_id, meta)

    def supervise_resolver(self, *, required: bool) -> bool:
        """Restarts the instance's resolver if it died while routed sandboxes use it
        (the watcher calls this on every pass: docs/egress.md "The resolver"). True when
        it was restarted. A failure is logged and retried on the next pass, at most
        once a second; ``required`` as in ``_ensure_resolver``."""
        if resolver.pid_alive(self.config.state_dir / "resolver.pid"):
            return False
        now = time.monotonic()
        if now - self._resolver_restart_at < 1.0:
            return False
        self._resolver_restart_at = now
        log.warning("the instance's resolver is not running; restarting it")
        try:
            with file_lock(self.locks_dir / "instance.lock"):
                self._ensure_resolver(required=required)
        except BackendError as exc:
            log.error("could not restart the instance's resolver: %s", exc)
            return False
        self.resolver_restarts += 1
        return True

    def stop_resolver(self) -> None:
        resolver.stop(self.config.state_dir)

    def dns_log(self, sandbox_id: str, limit: int = 1000) -> list[dict[str, Any]]:
        """The sandbox's DNS queries as the resolver logged them, oldest first."""
        check_sandbox_id(sandbox_id)
        return resolver.read_log(self.config.state_dir, sandbox_id, limit)

    def teardown_instance(self) -> None:
        """Destroy every sandbox, then the bridge, host tables, cgroup group and
        subnet claim of this instance (tests, uninstall)."""
        # first: nothing below needs it, and a step that raises must not leave it running
        self.zygote.stop()
        resolver.stop(self.config.state_dir)
        with contextlib.suppress(OSError):
            (RESOLV_DIR / f"{self.names.nft_table}.conf").unlink()
        for d in sorted(self.sandboxes_dir.iterdir()):
            if d.is_dir():
                self.destroy(d.name)
        for item in self.inventory():
            self.reclaim(item)
        if self.isolated:
            with contextlib.suppress(OSError, ValueError):  # none claimed: nothing to release
                subnet = ipaddress.IPv4Network(self.network.subnet_file.read_text().strip())
                idmap.release_blocks(self.config.claims_dir, subnet)
            self.network.teardown_instance()
        self.cgroups.remove_group()
        self._release_roots_dir()
        if self.storage is not None:
            self.storage.teardown()  # unmount (the loop device goes too), delete the image

    def _release_roots_dir(self) -> None:
        path = os.fsencode(self.roots_dir)
        while _is_shared_mount(self.roots_dir) and _libc.umount2(path, 0) == 0:
            pass
        with contextlib.suppress(OSError):
            self.roots_dir.rmdir()
        self._roots_shared = False
        for fd in self._userns.values():
            os.close(fd)
        self._userns.clear()

    def release_storage(self) -> None:
        """Unmounts the sandbox storage, keeping it for the next start (`make down`,
        after every sandbox is destroyed and the zygote stopped)."""
        if self.storage is not None:
            self.storage.release()

    def check_disk(self, disk_bytes: int, min_free_bytes: int | None = None) -> None:
        """Raises DiskExhausted when a new sandbox must not start: the state dir's or
        the image store's filesystem has less than ``min_free_bytes`` free (default:
        the image reserve), or the sandbox storage has less room than ``disk_bytes``
        (the sandbox's quota). Three statvfs calls; nothing is written."""
        reserve = self.config.image_min_free_bytes if min_free_bytes is None else min_free_bytes
        for label, path in (
            ("state dir", self.config.state_dir),
            ("image store", self.config.image_store),
        ):
            while not path.exists() and path != path.parent:
                path = path.parent  # not made yet: the filesystem it will be on
            free = _free_bytes(path)
            if free < reserve:
                raise DiskExhausted(
                    f"the {label}'s filesystem ({path}) has {free >> 20} MiB free, below "
                    f"the {reserve >> 20} MiB reserve (HEDGEROW_IMAGE_MIN_FREE_MIB)"
                )
        if self.storage is not None and self.storage.mounted():
            free = _free_bytes(self.storage.mount)
            if free < disk_bytes:
                raise DiskExhausted(
                    f"the sandbox storage ({self.storage.mount}) has {free >> 20} MiB free, "
                    f"less than a sandbox's {disk_bytes >> 20} MiB disk "
                    "(HEDGEROW_SANDBOX_DISK_MIB; the storage's size is "
                    "HEDGEROW_SANDBOX_DISK_SIZE_MIB)"
                )

    def disk_usage(self, sandbox_id: str) -> int | None:
        """Bytes the sandbox's /workspace and /tmp use; None when unbounded or unknown."""
        check_sandbox_id(sandbox_id)
        return self.storage.usage(sandbox_id) if self.storage is not None else None

    # ---- inventory -------------------------------------------------------------------

    def inventory(self) -> list[InventoryItem]:
        items: list[InventoryItem] = []
        metas: dict[str, dict[str, Any]] = {}
        # Quota groups before directories: provision makes the directory before the
        # group, so a group being provisioned always has its owner in this listing.
        qgroups = self.storage.qgroups() if self.storage is not None else []
        try:
            dirs = sorted(p for p in self.sandboxes_dir.iterdir() if p.is_dir())
        except OSError as exc:
            raise BackendError(f"cannot list {self.sandboxes_dir}: {exc}") from exc
        for d in dirs:
            meta = self._meta(d.name) or {}
            metas[d.name] = meta
            gen = meta.get("generation")
            items.append(InventoryItem("directory", str(d), d.name, gen, self.node))
            if self._alive(meta):
                items.append(InventoryItem("process", str(meta["pid"]), d.name, gen, self.node))

        def gen_of(sid: str | None) -> int | None:
            return metas.get(sid or "", {}).get("generation")

        if self.storage is not None:
            volumes = self.storage.volumes()
            for vol_sid in volumes:
                vol_path = str(self.storage.mount / vol_sid)
                items.append(InventoryItem("volume", vol_path, vol_sid, gen_of(vol_sid), self.node))
            owners = {qgroup_of(sid): sid for sid in [*metas, *volumes]}
            for qid in qgroups:
                q_sid = owners.get(qid)
                name = f"qgroup:{qgroup_name(qid)}"
                items.append(InventoryItem("qgroup", name, q_sid, gen_of(q_sid), self.node))
            for device in self.storage.stray_loops():
                items.append(InventoryItem("loop", device, None, None, self.node))

        # Neighbour entries are listed before the claims: provision claims an address
        # before it adds the entry, destroy deletes the entry before it releases the
        # claim, so a live sandbox's entry always has its claim in this listing.
        neighbours = self.network.list_neighbours() if self.isolated else []
        claims = self.network.claims()
        for ip, owner_id in claims:
            items.append(
                InventoryItem("address", ip, owner_id or None, gen_of(owner_id), self.node)
            )
        for _controller, path in self.cgroups.listing():
            items.append(
                InventoryItem("cgroup", str(path), path.name, gen_of(path.name), self.node)
            )
        if self.isolated or self.network.list_netns():
            for ns in self.network.list_netns():
                ns_sid = self.names.sandbox_from_netns(ns)
                items.append(InventoryItem("netns", ns, ns_sid, gen_of(ns_sid), self.node))
            for name, veth_sid in self.network.list_veths():
                items.append(InventoryItem("veth", name, veth_sid, gen_of(veth_sid), self.node))
            owner = dict(claims)
            if any(ip not in owner for ip in neighbours):
                # A destroy between the two listings deletes its entry, then its claim:
                # its entry would look unowned. Listed again, an entry that is still
                # there was not being destroyed; its claim is read again too (a
                # provision since the first listing claims before it adds the entry).
                still = set(self.network.list_neighbours())
                neighbours = [ip for ip in neighbours if ip in owner or ip in still]
                owner.update(self.network.claims())
            for ip in neighbours:
                neigh_sid = owner.get(ip)
                items.append(
                    InventoryItem(
                        "neighbour", f"neigh:{ip}", neigh_sid, gen_of(neigh_sid), self.node
                    )
                )
            for ip in self.network.list_egress():
                rule_sid = owner.get(ip)
                items.append(
                    InventoryItem("nft_rule", f"egress:{ip}", rule_sid, gen_of(rule_sid), self.node)
                )
            for ip in self.network.list_allowlisted():  # an allowlist's elements
                rule_sid = owner.get(ip)
                items.append(
                    InventoryItem("nft_rule", f"allow:{ip}", rule_sid, gen_of(rule_sid), self.node)
                )
        items += self._image_inventory(gen_of)
        return items

    # OCI image leftovers (docs/images.md "Leftovers"): a sandbox's root mount point,
    # this instance's leases in the machine-wide store (by holder prefix), and staging
    # layouts no pull writes any more (machine-wide: whichever instance lists one first
    # removes it; they name no sandbox, so they are reclaimed as unowned).

    def _existing_store(self) -> ImageStore | None:
        if self._store is None:
            root = self.config.image_store
            if not root.is_dir():
                return None  # nothing ever pulled or imported on this machine
            if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
                # another user's store (an unprivileged dev instance): this instance
                # cannot pull into it, so it holds no lease or staging there
                return None
        return self._image_store()

    def _image_inventory(self, gen_of: Callable[[str | None], int | None]) -> list[InventoryItem]:
        items: list[InventoryItem] = []
        roots = self.roots_dir
        try:
            root_dirs = sorted(roots.iterdir()) if roots.is_dir() else []
            store = self._existing_store()
            leases = store.leased() if store is not None else {}
            staging = store.stale_staging(STAGING_STALE_S) if store is not None else []
        except (OSError, ValueError) as exc:
            raise BackendError(f"cannot list image leftovers: {exc}") from exc
        for d in root_dirs:
            sid = d.name if _is_sandbox_id(d.name) else None
            items.append(InventoryItem("sandbox_root", str(d), sid, gen_of(sid), self.node))
        prefix = lease_holder(self.config.instance, "")
        for holder in sorted(leases):
            if holder.startswith(prefix):
                sid = holder.removeprefix(prefix)
                items.append(
                    InventoryItem("image_lease", f"lease:{holder}", sid, gen_of(sid), self.node)
                )
        for stage in staging:
            items.append(InventoryItem("image_staging", str(stage), None, None, self.node))
        return items

    def _reclaim_image_item(self, item: InventoryItem) -> None:
        kind, name = item.kind, item.name
        if kind == "image_lease":
            holder = name.removeprefix("lease:")
            prefix = lease_holder(self.config.instance, "")
            sid = holder.removeprefix(prefix)
            if not holder.startswith(prefix) or not _is_sandbox_id(sid):
                raise BackendError(f"{name} is not an image lease of this instance")
            with self._lock(sid):
                store = self._existing_store()
                if store is not None:
                    store.release(holder)
        elif kind == "sandbox_root":
            path = Path(name)
            if path.parent != self.roots_dir or not _is_sandbox_id(path.name):
                raise BackendError(f"{name} is not a sandbox root of this instance")
            with self._lock(path.name):
                try:
                    # lazily: a process still inside keeps its view until it exits
                    while str(path) in _mount_points():
                        unmount_rootfs(path)
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise BackendError(f"cannot remove sandbox root {name}: {exc}") from exc
        elif kind == "image_staging":
            store = self._existing_store()
            if store is None:
                return
            try:
                store.drop_staging(Path(name), STAGING_STALE_S)
            except ValueError as exc:
                raise BackendError(str(exc)) from exc
            except OSError as exc:
                raise BackendError(f"cannot remove staging layout {name}: {exc}") from exc
        else:
            raise BackendError(f"unknown inventory kind {kind!r}")

    def reclaim(self, item: InventoryItem) -> None:
        kind, name = item.kind, item.name
        if kind == "directory":
            path = Path(name)
            if path.parent != self.sandboxes_dir:
                raise BackendError(f"{name} is not a sandbox directory of this instance")
            shutil.rmtree(path, ignore_errors=True)
        elif kind == "process":
            meta = self._meta(item.sandbox_id or "") or {}
            if str(meta.get("pid")) == name:
                kill_and_wait(int(name), meta.get("start_time"))
        elif kind == "address":
            self.network.release_ip(name)
        elif kind == "cgroup":
            path = Path(name)
            if path not in {p for _, p in self.cgroups.listing()}:
                raise BackendError(f"{name} is not a cgroup of this instance")
            self.cgroups.remove(path)
        elif kind == "netns":
            sid = self.names.sandbox_from_netns(name)
            if sid is None:
                raise BackendError(f"{name} is not a netns of this instance")
            kill_pids(self.network.netns_pids(sid))
            self.network.delete_netns(name)
        elif kind == "veth":
            if name not in {n for n, _ in self.network.list_veths()}:
                return
            self.network.delete_veth(name)
        elif kind == "neighbour":
            ip = name.removeprefix("neigh:")
            # Listed without a claim; claimed since, it is a new sandbox's entry
            # (the same MAC: addresses keep theirs), which its destroy removes.
            if ip not in dict(self.network.claims()):
                self.network.delete_neighbour(ip)
        elif kind == "nft_rule" and name.startswith("allow:"):
            ip = name.removeprefix("allow:")
            # claimed since: a new sandbox's, which its own destroy removes
            if ip not in dict(self.network.claims()):
                self.network.delete_allowlist(ip, None)
        elif kind == "nft_rule":
            self.network.delete_egress(name.removeprefix("egress:"))
        elif kind in ("volume", "qgroup", "loop") and self.storage is None:
            raise BackendError(f"{kind} {name}: this backend has no sandbox storage")
        elif kind == "volume" and self.storage is not None:
            path = Path(name)
            if path.parent != self.storage.mount:
                raise BackendError(f"{name} is not a sandbox volume of this instance")
            self.storage.remove(path.name)
        elif kind == "qgroup" and self.storage is not None:
            qid = _parse_qgroup(name)
            # listed without an owner; one made since for a new sandbox is left to it
            owners = {qgroup_of(p.name) for p in self.sandboxes_dir.iterdir()}
            if qid not in owners | {qgroup_of(sid) for sid in self.storage.volumes()}:
                self.storage.delete_qgroup(qid)
        elif kind == "loop" and self.storage is not None:
            self.storage.detach_loop(name)
        else:
            self._reclaim_image_item(item)

    # ---- events ----------------------------------------------------------------------

    def watch(self, timeout_s: float) -> Iterator[BackendEvent]:
        deadline = time.monotonic() + timeout_s
        while True:
            seen: set[tuple[str, int | None]] = set()
            routed: list[EgressPolicy] = []
            for d in sorted(self.sandboxes_dir.iterdir()):
                meta = self._meta(d.name)
                if not meta or meta.get("state") != "started":
                    continue
                policy = _meta_policy(meta)
                if policy is not None and policy.routed:
                    routed.append(policy)
                key = (d.name, meta.get("generation"))
                seen.add(key)
                if key not in self._gone_reported and not self._alive(meta):
                    self._gone_reported.add(key)
                    reason = "agent process exited"
                    if is_alive(meta.get("pid"), meta.get("start_time")):
                        # the agent died, something else kept the sandbox up: end it
                        # all, as an agent's death must (orphans included)
                        with contextlib.suppress(BackendError):
                            kill_and_wait(int(meta["pid"]), meta.get("start_time"))
                        reason = "agent process exited; the sandbox's other processes were killed"
                    yield BackendEvent(d.name, key[1], "gone", reason)
            self._gone_reported &= seen
            if routed:
                self.supervise_resolver(required=any(p.mode == "allow" for p in routed))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(0.5, remaining))


def _parse_qgroup(name: str) -> int:
    level, _, ident = name.removeprefix("qgroup:").partition("/")
    if level != "1" or not ident.isdigit():
        raise BackendError(f"{name} is not a sandbox quota group")
    return (1 << 48) | int(ident)


def _is_shared_mount(path: Path) -> bool:
    """A mount point at ``path`` (topmost) that is shared (mountinfo's optional
    fields name a peer group)."""
    found = False
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if len(fields) > 6 and fields[4] == str(path):
            optional = fields[6 : fields.index("-")]
            found = any(f.startswith("shared:") for f in optional)
    return found


def _own_umask() -> int:
    # os.umask() can only be read by setting it, which races with other threads
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


def _check_traversable(state_dir: Path) -> None:
    """bwrap runs as the sandbox's unprivileged root: it reaches the sandbox's dirs
    (bind sources under the state dir) only through directories others may search."""
    for path in [state_dir.absolute(), *state_dir.absolute().parents]:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            continue  # made later, 0755
        if not mode & stat.S_IXOTH:
            raise BackendError(
                f"{path} must be searchable by others (chmod o+x): sandboxes run as "
                "unprivileged host ids and bind their directories from under it"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(endpoint: Endpoint, token: str = "", timeout: float = 15) -> dict[str, Any]:
    """Poll ``GET /health`` until the agent answers 200; returns its JSON body."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: Exception | None = None
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=2)
        try:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            conn.request("GET", "/health", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status == 200:
                data = json.loads(body)
                return data if isinstance(data, dict) else {"body": data}
            last = BackendError(f"/health answered {resp.status}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            last = exc
        finally:
            conn.close()
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    raise BackendError(
        f"agent at {endpoint.host}:{endpoint.port} not healthy: {last}", transient=True
    )


def _meta_policy(meta: dict[str, Any]) -> EgressPolicy | None:
    """The egress policy meta.json records; None when unknown (no meta, or a bad one):
    destroy then removes every kind of egress element the address may hold."""
    if "egress" in meta:
        try:
            return parse_egress(meta["egress"])
        except EgressError:
            return None
    if "network_access" in meta:  # written before egress policies existed
        return ALL if meta["network_access"] else NONE
    return None
