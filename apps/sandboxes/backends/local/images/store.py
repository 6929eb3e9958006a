"""The image store: OCI images pulled once into a content-addressed cache on disk.

Layout of ``root`` (docs/images.md)::

    blobs/sha256/<hex>     every verified blob (manifests, configs, layers), stored once
    layers/<hex>/fs        each layer unpacked once, in overlayfs form (lower dir)
    layers/<hex>/layer.json  diff id, sizes
    images/<hex>.json      one record per image manifest digest
    refs/<sha256(ref)>.json  the digest a reference last resolved to, for listing
    staging/<hex>/         the OCI layout skopeo writes one pull into: kept across a
                           crash, so a retried pull fetches only the missing blobs
    locks/<hex>.lock       flock per manifest and per layer: single-flight pulls
    tmp/                   auth files (0600) and layers being unpacked

Every blob is hashed before it enters ``blobs/`` (a mismatch is refused, deleted and
raised as DigestMismatch), every layer's uncompressed stream is checked against the
config's diff id, and every manifest against the digest it was asked or resolved by.
A pull always asks the registry for the manifest with the caller's own credentials,
even when every blob is cached: cached content is never handed to a caller who has not
proved access to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import errors
from .egress import RegistryPolicy
from .proxy import EgressProxy
from .reference import Reference, parse
from .skopeo import Credentials, Skopeo, authfile
from .unpack import unpack_layer

INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

Progress = Callable[[dict[str, Any]], None]


@dataclass
class LayerInfo:
    digest: str  # of the compressed blob, as the manifest lists it
    diff_id: str  # of the uncompressed tar, as the config lists it
    size: int  # compressed bytes


@dataclass
class ImageConfig:
    env: list[str] = field(default_factory=list)
    working_dir: str = ""
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


@dataclass
class ImageRecord:
    reference: str  # as last pulled, normalised (docker.io/library/…)
    digest: str  # the image manifest's digest: what a sandbox records it ran
    index_digest: str | None  # the index it was resolved from, if any
    config_digest: str
    platform: str  # os/arch
    layers: list[LayerInfo]  # bottom first, as in the manifest
    config: ImageConfig
    size: int  # compressed bytes of config + layers
    unpacked_size: int
    pulled_at: float
    last_used: float

    @staticmethod
    def from_json(d: dict[str, Any]) -> ImageRecord:
        d = dict(d)
        d["layers"] = [LayerInfo(**x) for x in d["layers"]]
        d["config"] = ImageConfig(**d["config"])
        return ImageRecord(**d)


def _hex(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise errors.ImageStoreError(digest, "only sha256 digests are supported")
    return hexd


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    # unique per writer: threads of one process write the same refs file
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@contextlib.contextmanager
def _flock(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _progress(blobs: Path, total: int, layers: int, emit: Progress) -> Iterator[None]:
    """Emit {"phase": "fetching", "bytes", "total"} while skopeo writes into blobs
    (its partial files included), every 0.25 s when the count moved."""
    stop = threading.Event()

    def poll() -> None:
        last = -1
        while not stop.wait(0.25):
            done = 0
            with contextlib.suppress(OSError):
                for entry in os.scandir(blobs):
                    with contextlib.suppress(OSError):
                        done += entry.stat(follow_symlinks=False).st_size
            if done != last:
                last = done
                emit(
                    {
                        "phase": "fetching",
                        "layers": layers,
                        "bytes": min(done, total),
                        "total": total,
                    }
                )

    t = threading.Thread(target=poll, name="image-pull-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


class ImageStore:
    def __init__(
        self,
        root: Path,
        *,
        os_name: str = "linux",
        architecture: str = "amd64",
        policy: RegistryPolicy | Callable[[], RegistryPolicy] | None = None,
        min_free_bytes: int = 0,
        skopeo: Skopeo | None = None,
    ) -> None:
        """policy: the registry egress policy (egress.py), or a function returning the
        current one (asked at every pull and resolve). None: the default policy —
        public registries only, none over plain HTTP."""
        self.root = root
        self.platform = (os_name, architecture)
        self._policy = policy if policy is not None else RegistryPolicy()
        self.min_free_bytes = min_free_bytes
        self.skopeo = skopeo or Skopeo()
        # every connection skopeo opens (redirects and token realms included) is
        # checked again where it is made, to the address checked (proxy.py)
        self.proxy = EgressProxy(lambda: self.policy)
        if self.skopeo.proxy is None:
            self.skopeo.proxy = lambda: self.proxy.url
        # test seam: called with "blobs_fetched" between download and store
        self.fault_hook: Callable[[str], None] | None = None
        self.blobs = root / "blobs" / "sha256"
        self.layers_dir = root / "layers"
        self.images_dir = root / "images"
        self.refs_dir = root / "refs"
        self.staging = root / "staging"
        self.locks = root / "locks"
        self.tmp = root / "tmp"
        self.leases = root / "leases"
        for d in (
            self.blobs,
            self.layers_dir,
            self.images_dir,
            self.refs_dir,
            self.staging,
            self.leases,
        ):
            d.mkdir(parents=True, exist_ok=True)
        for d in (self.locks, self.tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    # ---- queries -------------------------------------------------------------------

    @property
    def policy(self) -> RegistryPolicy:
        return self._policy if isinstance(self._policy, RegistryPolicy) else self._policy()

    def is_insecure(self, ref: Reference) -> bool:
        """Plain HTTP (and unverified TLS) only for the policy's ``insecure`` list."""
        return self.policy.plain_http(ref)

    def _egress(self, ref: Reference) -> bool:
        """Checks the registry against the egress policy now (resolving its name again)
        and returns whether it may be reached over plain HTTP. Called before every
        skopeo call that contacts a registry: a name that rebinds between the resolve
        and the fetch is refused at the fetch."""
        policy = self.policy
        policy.check(ref)
        return policy.plain_http(ref)

    def get(self, digest: str) -> ImageRecord | None:
        path = self.images_dir / f"{_hex(digest)}.json"
        try:
            return ImageRecord.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def records(self) -> list[ImageRecord]:
        out = []
        for p in sorted(self.images_dir.glob("*.json")):
            out.append(ImageRecord.from_json(json.loads(p.read_text())))
        return out

    def layer_path(self, layer_digest: str) -> Path:
        return self.layers_dir / _hex(layer_digest) / "fs"

    def lower_dirs(self, record: ImageRecord) -> list[Path]:
        """The overlayfs lowerdir list: topmost layer first."""
        return [self.layer_path(x.digest) for x in reversed(record.layers)]

    def touch(self, digest: str) -> None:
        """Mark an image used now (LRU): the launch calls it per sandbox."""
        # under the collect lock: a record collected meanwhile must not be rewritten
        with _flock(self.locks / "collect.lock", fcntl.LOCK_SH):
            rec = self.get(digest)
            if rec is not None:
                rec.last_used = time.time()
                _write_json(self.images_dir / f"{_hex(digest)}.json", asdict(rec))

    # ---- pull ----------------------------------------------------------------------

    def pull(
        self,
        reference: str,
        *,
        credentials: Credentials | None = None,
        progress: Progress | None = None,
        lease: str | None = None,
    ) -> ImageRecord:
        """Pull reference (always asking the registry, with these credentials) and
        return its record. lease: a holder name (the sandbox id) whose lease on the
        image is taken before the pull ends, so collection cannot remove it between
        the pull and the sandbox's mount; ``release(holder)`` drops it."""
        ref = parse(reference)
        emit = progress or (lambda _e: None)
        with authfile(self.tmp, ref.registry, credentials) as auth:
            digest, index_digest, raw, doc = self._resolve(ref, auth)
            emit({"phase": "resolved", "digest": digest})
            with (
                _flock(self.locks / "collect.lock", fcntl.LOCK_SH),
                _flock(self.locks / f"{_hex(digest)}.lock"),
            ):
                rec = self.get(digest)
                if rec is None or not all(self.layer_path(x.digest).is_dir() for x in rec.layers):
                    try:
                        rec = self._fetch(ref, digest, index_digest, raw, doc, auth, emit)
                    except errors.ImageError:
                        # a refused pull keeps nothing to resume (verified blobs and
                        # layers it stored are swept by the next collect); a crash
                        # (any other exception, or none at all) keeps its staging
                        shutil.rmtree(self.staging / _hex(digest), ignore_errors=True)
                        raise
                rec.reference = str(ref)
                rec.last_used = time.time()
                _write_json(self.images_dir / f"{_hex(digest)}.json", asdict(rec))
                if lease is not None:
                    self._lease(lease, digest)
        ref_key = hashlib.sha256(str(ref).encode()).hexdigest()[:32]
        _write_json(self.refs_dir / f"{ref_key}.json", {"reference": str(ref), "digest": digest})
        emit({"phase": "done", "digest": digest})
        return rec

    def lease_stored(self, digest: str, holder: str) -> ImageRecord | None:
        """Lease an image the store already holds completely, without asking the
        registry: the caller has proved access itself (the backend's resolve cache,
        within its window). Under the manifest lock (and the collect lock, shared), so
        it never leases a record a pull is still writing or a collection is removing.
        None when the record or any of its layers is missing: pull it instead."""
        with (
            _flock(self.locks / "collect.lock", fcntl.LOCK_SH),
            _flock(self.locks / f"{_hex(digest)}.lock"),
        ):
            rec = self.get(digest)
            if rec is None or not all(self.layer_path(x.digest).is_dir() for x in rec.layers):
                return None
            rec.last_used = time.time()
            _write_json(self.images_dir / f"{_hex(digest)}.json", asdict(rec))
            self._lease(holder, digest)
            return rec

    def resolve(self, reference: str, *, credentials: Credentials | None = None) -> str:
        """The manifest digest ``reference`` names for this platform, asked of the
        registry with these credentials (the layers are not fetched): proves access."""
        ref = parse(reference)
        with authfile(self.tmp, ref.registry, credentials) as auth:
            return self._resolve(ref, auth)[0]

    def _resolve(self, ref: Reference, auth: Path) -> tuple[str, str | None, bytes, dict[str, Any]]:
        """(manifest digest, index digest or None, manifest bytes, manifest JSON)."""
        raw = self.skopeo.manifest(ref, ref.transport, auth, self._egress(ref))
        top_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if ref.digest and top_digest != ref.digest:
            raise errors.DigestMismatch(str(ref), f"registry served {top_digest} for {ref.digest}")
        doc = self._json(ref, raw)
        index_digest = None
        if self._media_type(doc) in INDEX_TYPES:
            index_digest = top_digest
            digest = self._choose(ref, doc)
            raw = self.skopeo.manifest(ref, ref.with_digest(digest), auth, self._egress(ref))
            if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
                raise errors.DigestMismatch(str(ref), f"registry served other bytes for {digest}")
            doc = self._json(ref, raw)
        else:
            digest = top_digest
        if self._media_type(doc) not in MANIFEST_TYPES:
            raise errors.ImageStoreError(
                str(ref), f"unsupported manifest type {self._media_type(doc)!r}"
            )
        self._check_manifest(str(ref), doc)
        return digest, index_digest, raw, doc

    def import_archive(
        self,
        path: Path,
        reference: str,
        *,
        progress: Progress | None = None,
        lease: str | None = None,
    ) -> ImageRecord:
        """Import an image for machines that reach no registry: an OCI image layout
        (a directory) or a ``docker save`` tarball, recorded under reference (a name
        of the caller's choosing, e.g. ``import/swe-task:1``). Its blobs are verified
        and stored like pulled ones; an index is resolved for this platform by skopeo.
        """
        ref = parse(reference)
        emit = progress or (lambda _e: None)
        if not path.exists():
            raise errors.ImageNotFound(reference, f"{path}: no such file or directory")
        source = f"oci:{path}" if path.is_dir() else f"docker-archive:{path}"
        stage = self.staging / f"import-{uuid.uuid4().hex}"
        try:
            with _flock(self.locks / "collect.lock", fcntl.LOCK_SH):
                self.skopeo.copy_from(reference, source, stage)
                index = self._json(ref, (stage / "index.json").read_bytes())
                manifests = index.get("manifests") or []
                if len(manifests) != 1:
                    raise errors.ImageStoreError(reference, "the archive holds no single image")
                digest = str(manifests[0]["digest"])
                raw = (stage / "blobs" / "sha256" / _hex(digest)).read_bytes()
                if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
                    raise errors.DigestMismatch(reference, f"manifest is not {digest}")
                doc = self._json(ref, raw)
                if self._media_type(doc) not in MANIFEST_TYPES:
                    raise errors.ImageStoreError(reference, "unsupported manifest type")
                self._check_manifest(reference, doc)
                with _flock(self.locks / f"{_hex(digest)}.lock"):
                    rec = self.get(digest)
                    if rec is None or not all(
                        self.layer_path(x.digest).is_dir() for x in rec.layers
                    ):
                        rec = self._commit(ref, digest, None, raw, doc, stage, emit)
                    rec.reference = str(ref)
                    rec.last_used = time.time()
                    _write_json(self.images_dir / f"{_hex(digest)}.json", asdict(rec))
                    if lease is not None:
                        self._lease(lease, digest)
        finally:
            # an import has nothing to resume from: the archive is still there
            shutil.rmtree(stage, ignore_errors=True)
        emit({"phase": "done", "digest": digest})
        return rec

    def _json(self, ref: Reference, raw: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise errors.ImageStoreError(str(ref), f"manifest is not JSON: {e}") from e
        if not isinstance(doc, dict):
            raise errors.ImageStoreError(str(ref), "manifest is not a JSON object")
        return doc

    @staticmethod
    def _check_manifest(ref: str, doc: dict[str, Any]) -> None:
        """The fields the store reads, with the types it needs: a registry's (or an
        archive's) bad JSON is a typed error, never a KeyError."""

        def descriptor(d: Any) -> bool:
            return (
                isinstance(d, dict)
                and isinstance(d.get("digest"), str)
                and isinstance(d.get("size"), int)
                and not isinstance(d.get("size"), bool)
                and d["size"] >= 0
            )

        layers = doc.get("layers")
        if not descriptor(doc.get("config")) or not isinstance(layers, list):
            raise errors.ImageStoreError(ref, "manifest has no valid config or layers")
        if not layers or not all(descriptor(x) for x in layers):
            raise errors.ImageStoreError(ref, "manifest lists no layers or an invalid one")
        for d in [doc["config"], *layers]:
            _hex(d["digest"])

    @staticmethod
    def _media_type(doc: dict[str, Any]) -> str:
        mt = doc.get("mediaType")
        if isinstance(mt, str):
            return mt
        # OCI allows mediaType to be absent: an index has manifests, an image layers
        if "manifests" in doc:
            return "application/vnd.oci.image.index.v1+json"
        if "layers" in doc:
            return "application/vnd.oci.image.manifest.v1+json"
        return ""

    def _choose(self, ref: Reference, index: dict[str, Any]) -> str:
        os_name, arch = self.platform
        offered = []
        manifests = index.get("manifests")
        for m in manifests if isinstance(manifests, list) else []:
            p = (m.get("platform") if isinstance(m, dict) else None) or {}
            offered.append(f"{p.get('os')}/{p.get('architecture')}")
            if p.get("os") == os_name and p.get("architecture") == arch:
                digest = m.get("digest")
                if not isinstance(digest, str):
                    raise errors.ImageStoreError(str(ref), "index entry without a digest")
                _hex(digest)
                return digest
        raise errors.UnsupportedPlatform(
            str(ref), f"no manifest for {os_name}/{arch}; the index offers {', '.join(offered)}"
        )

    def _fetch(
        self,
        ref: Reference,
        digest: str,
        index_digest: str | None,
        raw: bytes,
        manifest: dict[str, Any],
        auth: Path,
        emit: Progress,
    ) -> ImageRecord:
        config_desc = manifest["config"]
        layer_descs = manifest.get("layers", [])
        wanted = [config_desc, *layer_descs]
        stage = self.staging / _hex(digest)
        stage_blobs = stage / "blobs" / "sha256"
        stage_blobs.mkdir(parents=True, exist_ok=True)
        missing = 0
        for d in wanted:
            have = self.blobs / _hex(d["digest"])
            if have.exists() and not (stage_blobs / have.name).exists():
                os.link(have, stage_blobs / have.name)  # skopeo skips blobs the layout has
            elif not have.exists():
                missing += int(d.get("size", 0))
        self._guard_disk(ref, missing, layer_descs)
        total = sum(int(d.get("size", 0)) for d in wanted)
        with _progress(stage_blobs, total, len(layer_descs), emit):
            self.skopeo.copy(ref, digest, stage, auth, self._egress(ref))
        emit({"phase": "fetched", "layers": len(layer_descs), "bytes": total, "total": total})
        if self.fault_hook:
            self.fault_hook("blobs_fetched")
        return self._commit(ref, digest, index_digest, raw, manifest, stage, emit)

    def _commit(
        self,
        ref: Reference,
        digest: str,
        index_digest: str | None,
        raw: bytes,
        manifest: dict[str, Any],
        stage: Path,
        emit: Progress,
    ) -> ImageRecord:
        """Verify the staged blobs into the store, unpack the layers, build the record
        (and drop the staging layout)."""
        config_desc = manifest["config"]
        layer_descs = manifest.get("layers", [])
        stage_blobs = stage / "blobs" / "sha256"
        for d in [config_desc, *layer_descs]:
            self._store_blob(ref, stage_blobs / _hex(d["digest"]), d["digest"], d.get("size"))
        self._store_bytes(raw, digest)
        config = self._json(ref, (self.blobs / _hex(config_desc["digest"])).read_bytes())
        if (config.get("os"), config.get("architecture")) != self.platform:
            raise errors.UnsupportedPlatform(
                str(ref), f"image is {config.get('os')}/{config.get('architecture')}"
            )
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(layer_descs):
            raise errors.ImageStoreError(str(ref), "config lists a different number of layers")
        layers = [
            LayerInfo(str(d["digest"]), str(diff), int(d.get("size", 0)))
            for d, diff in zip(layer_descs, diff_ids, strict=True)
        ]
        unpacked = 0
        for i, layer in enumerate(layers):
            unpacked += self._unpack(ref, layer)
            emit({"phase": "unpacked", "layer": i + 1, "layers": len(layers)})
        c = config.get("config") or {}
        rec = ImageRecord(
            reference=str(ref),
            digest=digest,
            index_digest=index_digest,
            config_digest=str(config_desc["digest"]),
            platform="/".join(self.platform),
            layers=layers,
            config=ImageConfig(
                env=list(c.get("Env") or []),
                working_dir=str(c.get("WorkingDir") or ""),
                user=str(c.get("User") or ""),
                entrypoint=list(c.get("Entrypoint") or []),
                cmd=list(c.get("Cmd") or []),
            ),
            size=int(config_desc.get("size", 0)) + sum(x.size for x in layers),
            unpacked_size=unpacked,
            pulled_at=time.time(),
            last_used=time.time(),
        )
        shutil.rmtree(stage, ignore_errors=True)
        return rec

    def _guard_disk(self, ref: Reference, missing: int, layers: list[dict[str, Any]]) -> None:
        if not self.min_free_bytes and not missing:
            return
        # compressed blobs plus their unpacked form (estimated at 3x: gzip of code
        # and binaries), which must not eat into the reserve
        need = missing * 4
        free = shutil.disk_usage(self.root).free
        if free - need < self.min_free_bytes:
            raise errors.DiskExhausted(
                str(ref),
                f"pull needs ~{need} bytes, {free} free, reserve {self.min_free_bytes}",
            )

    def _store_blob(self, ref: Reference, staged: Path, digest: str, size: Any) -> None:
        final = self.blobs / _hex(digest)
        if final.exists():
            return
        if not staged.exists():
            raise errors.ImageStoreError(str(ref), f"skopeo did not fetch {digest}")
        actual = _sha256_file(staged)
        if actual != digest or (size is not None and staged.stat().st_size != int(size)):
            staged.unlink()
            raise errors.DigestMismatch(str(ref), f"blob {digest} has content {actual}")
        os.chmod(staged, 0o444)
        with contextlib.suppress(FileExistsError):
            os.link(staged, final)

    def _store_bytes(self, data: bytes, digest: str) -> None:
        final = self.blobs / _hex(digest)
        if not final.exists():
            tmp = self.tmp / f"{_hex(digest)}.{os.getpid()}"
            tmp.write_bytes(data)
            os.chmod(tmp, 0o444)
            os.replace(tmp, final)

    def _unpack(self, ref: Reference, layer: LayerInfo) -> int:
        hexd = _hex(layer.digest)
        final = self.layers_dir / hexd
        with _flock(self.locks / f"layer-{hexd}.lock"):
            if (final / "fs").is_dir():
                return int(json.loads((final / "layer.json").read_text())["unpacked_size"])
            work = self.tmp / f"layer-{hexd}.{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            (work / "fs").mkdir(parents=True)
            try:
                with open(self.blobs / hexd, "rb") as f:
                    magic = f.read(4)
                    f.seek(0)
                    if magic.startswith(ZSTD_MAGIC):
                        raise errors.ImageStoreError(str(ref), "zstd layers are not supported")
                    size = unpack_layer(
                        f,
                        work / "fs",
                        ref=str(ref),
                        gzipped=magic.startswith(GZIP_MAGIC),
                        diff_id=layer.diff_id,
                    )
                _write_json(
                    work / "layer.json",
                    {"digest": layer.digest, "diff_id": layer.diff_id, "unpacked_size": size},
                )
                os.rename(work, final)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            return size

    # ---- leases and collection -----------------------------------------------------

    def _lease(self, holder: str, digest: str) -> None:
        if not holder or "/" in holder or holder.startswith("."):
            raise ValueError(f"bad lease holder {holder!r}")
        _write_json(self.leases / holder, {"digest": digest})

    def lease(self, holder: str, digest: str) -> ImageRecord:
        """A lease on an image already in the store (a snapshot's, or a sandbox
        restored from one: no registry asked, the digest is exact). Raises
        ImageStoreError when the image or one of its layers is gone."""
        with (
            _flock(self.locks / "collect.lock", fcntl.LOCK_SH),
            _flock(self.locks / f"{_hex(digest)}.lock"),
        ):
            rec = self.get(digest)
            if rec is None or not all(self.layer_path(x.digest).is_dir() for x in rec.layers):
                raise errors.ImageStoreError(digest, "the image is no longer in the store")
            self._lease(holder, digest)
        return rec

    def release(self, holder: str) -> None:
        """Drop holder's lease (the sandbox is gone). Idempotent."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.leases / holder)

    def leased(self) -> dict[str, str]:
        """holder → image digest, for every lease (the reconciler's inventory)."""
        out = {}
        for p in self.leases.iterdir():
            if not p.name.startswith("."):
                try:
                    text = p.read_text()
                except FileNotFoundError:
                    continue  # released between the listing and the read (another process)
                out[p.name] = str(json.loads(text)["digest"])
        return out

    # ---- stale staging (the reconciler's ``image_staging`` inventory) ---------------

    @contextlib.contextmanager
    def _staging_free(self, stage: Path) -> Iterator[bool]:
        """Holds the lock the writer of ``stage`` holds, if free (yields False when a
        pull or import is writing it). A pull's layout ``<hex>`` is written under its
        manifest lock; an import's ``import-*`` under the collect lock (shared)."""
        name = "collect" if stage.name.startswith("import-") else stage.name
        fd = os.open(self.locks / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    @staticmethod
    def _age(stage: Path) -> float:
        """Seconds since anything was added, renamed or written in the layout."""
        newest = 0.0
        for dirpath, _dirs, files in os.walk(stage):
            for p in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
                with contextlib.suppress(FileNotFoundError):
                    newest = max(newest, os.lstat(p).st_mtime)
        return time.time() - newest

    def stale_staging(self, min_age_s: float) -> list[Path]:
        """Staging layouts no pull or import is writing and nothing touched for
        ``min_age_s``: a crashed pull's layout (kept that long so a retry resumes it)
        or an import killed before its cleanup."""
        stale = []
        for stage in sorted(self.staging.iterdir()):
            if self._age(stage) < min_age_s:
                continue
            with self._staging_free(stage) as free:
                if free:
                    stale.append(stage)
        return stale

    def drop_staging(self, stage: Path, min_age_s: float) -> bool:
        """Delete one stale staging layout (checked again under its lock: a pull that
        started since keeps it). Idempotent; True if it was deleted."""
        if stage.parent != self.staging:
            raise ValueError(f"{stage} is not a staging layout of {self.root}")
        with self._staging_free(stage) as free:
            if not free or not stage.exists() or self._age(stage) < min_age_s:
                return False
            doomed = self.tmp / f"gc-staging-{stage.name}.{uuid.uuid4().hex}"
            os.rename(stage, doomed)
            shutil.rmtree(doomed)
            return True

    def usage(self) -> int:
        """Bytes the cache holds: blobs plus unpacked layers (file contents)."""
        total = sum(p.stat().st_size for p in self.blobs.iterdir())
        for d in self.layers_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += int(json.loads((d / "layer.json").read_text())["unpacked_size"])
        return total

    def collect(self, cap_bytes: int, in_use: frozenset[str] = frozenset()) -> list[str]:
        """Remove least recently used images until the cache holds at most cap_bytes,
        then every blob and layer no remaining image uses. An image leased or in
        in_use (digests) is never removed, nor anything it uses. Returns the digests
        of the images removed. Pulls wait while it runs (and it for them)."""
        removed: list[str] = []
        with _flock(self.locks / "collect.lock"):
            keep = set(in_use) | set(self.leased().values())
            records = sorted(self.records(), key=lambda r: r.last_used)
            usage = self._sweep()  # what failed pulls stored but no image uses
            for rec in records:
                if usage <= cap_bytes:
                    break
                if rec.digest in keep:
                    continue
                os.unlink(self.images_dir / f"{_hex(rec.digest)}.json")
                removed.append(rec.digest)
                usage = self._sweep()
            for p in self.refs_dir.iterdir():
                with contextlib.suppress(FileNotFoundError, ValueError):
                    if json.loads(p.read_text())["digest"] in removed:
                        p.unlink()
        return removed

    def remove(self, digest: str) -> bool:
        """Drop one image (its record, the references naming it, then every blob and
        layer no other image uses). False, and nothing removed, while it is leased."""
        with _flock(self.locks / "collect.lock"):
            if digest in set(self.leased().values()):
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.images_dir / f"{_hex(digest)}.json")
            for p in self.refs_dir.iterdir():
                with contextlib.suppress(FileNotFoundError, ValueError):
                    if json.loads(p.read_text())["digest"] == digest:
                        p.unlink()
            self._sweep()
        return True

    def _sweep(self) -> int:
        """Delete blobs and layers no image record names; returns the new usage."""
        used_blobs: set[str] = set()
        used_layers: set[str] = set()
        for rec in self.records():
            used_blobs.update({_hex(rec.digest), _hex(rec.config_digest)})
            if rec.index_digest:
                used_blobs.add(_hex(rec.index_digest))
            for layer in rec.layers:
                used_blobs.add(_hex(layer.digest))
                used_layers.add(_hex(layer.digest))
        for p in self.blobs.iterdir():
            if p.name not in used_blobs:
                p.unlink()
        for d in self.layers_dir.iterdir():
            if d.name not in used_layers:
                # out of sight first, so no half-deleted layer is ever a lower dir
                doomed = self.tmp / f"gc-{d.name}.{uuid.uuid4().hex}"
                os.rename(d, doomed)
                shutil.rmtree(doomed)
        return self.usage()
