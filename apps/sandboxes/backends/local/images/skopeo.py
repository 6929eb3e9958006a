"""The registry side, through Debian's skopeo: fetch manifests (inspect --raw) and blobs
(copy into an OCI layout), and turn its failures into the store's typed errors.

Credentials never reach argv or the environment: each call gets an ``--authfile`` (0600,
in a 0700 dir, removed after). An anonymous pull gets an empty one, so the host's own
docker/containers auth files are never used for a tenant's pull.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import errors
from .jail import Jail, is_loopback
from .reference import Reference

TIMEOUT_S = 600


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def __repr__(self) -> str:  # never print the password
        return f"Credentials(username={self.username!r}, password=***)"


@contextmanager
def authfile(tmp: Path, registry: str, creds: Credentials | None) -> Iterator[Path]:
    tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    auths: dict[str, dict[str, str]] = {}
    if creds is not None:
        token = base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
        auths[registry] = {"auth": token}
    fd, name = tempfile.mkstemp(prefix="auth-", suffix=".json", dir=tmp)
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp: 0600
            json.dump({"auths": auths}, f)
        yield Path(name)
    finally:
        os.unlink(name)


# skopeo 1.9's messages (containers/image), most specific first
_CLASSIFY: list[tuple[re.Pattern[str], type[errors.ImageError]]] = [
    (re.compile(r"digest did not match|digest mismatch", re.I), errors.DigestMismatch),
    (
        re.compile(r"unauthorized|authentication required|denied|invalid username/password", re.I),
        errors.RegistryUnauthorized,
    ),
    (re.compile(r"manifest unknown|name unknown|blob unknown", re.I), errors.ImageNotFound),
    (
        re.compile(r"no image found in manifest list|choosing image instance", re.I),
        errors.UnsupportedPlatform,
    ),
    (
        re.compile(
            r"connection refused|no such host|i/o timeout|dial tcp|tls:|x509|"
            r"server gave HTTP response to HTTPS client|pinging container registry|"
            r"connection reset|EOF",
            re.I,
        ),
        errors.RegistryUnreachable,
    ),
    (re.compile(r"no space left on device", re.I), errors.DiskExhausted),
]


def _message(stderr: str) -> str:
    """skopeo's fatal line without its logrus wrapping."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "skopeo failed"
    m = re.search(r'msg="((?:[^"\\]|\\.)*)"', last)
    return m.group(1).replace('\\"', '"') if m else last


def classify(ref: str, stderr: str) -> errors.ImageError:
    """The typed error for skopeo's failure: the tenant's message is the code's fixed
    text (skopeo's names internal addresses and ports), skopeo's own is ``detail``."""
    msg = _message(stderr)
    for pattern, cls in _CLASSIFY:
        if pattern.search(msg):
            return cls(ref, errors.PUBLIC_MESSAGES[cls.code], detail=msg)
    return errors.ImageStoreError(ref, errors.PUBLIC_MESSAGES["image_store_error"], detail=msg)


class NoNetworkNamespace(errors.ImageStoreError):
    """Not root, no namespace for skopeo, and the operator did not accept open loopback
    (``allow_unprotected_loopback``): nothing was run."""


_PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy")


class Skopeo:
    def __init__(
        self, binary: str = "skopeo", retry_times: int = 3, allow_unprotected_loopback: bool = False
    ) -> None:
        self.binary = binary
        self.retry_times = retry_times
        # not root, there is no namespace (jail.py) and a redirect or token realm on
        # loopback would reach this machine's services: such calls are refused unless
        # the operator accepted that (HEDGEROW_REGISTRY_ALLOW_UNPROTECTED_LOOPBACK)
        self.allow_unprotected_loopback = allow_unprotected_loopback
        # the registry egress proxy's URL (proxy.py), set by the store: every
        # connection skopeo opens to a registry goes through it
        self.proxy: Callable[[], str] | None = None

    def _env(self) -> dict[str, str] | None:
        if self.proxy is None:
            return None
        url = self.proxy()
        env = {
            k: v for k, v in os.environ.items() if k not in _PROXY_VARS and k.lower() != "no_proxy"
        }
        env.update(HTTPS_PROXY=url, HTTP_PROXY=url, https_proxy=url, http_proxy=url)
        return env

    def _jail(self, env: dict[str, str] | None, registry: Reference | None) -> Jail | None:
        """skopeo's own network namespace (jail.py): loopback there reaches only the
        proxy and, for a loopback registry (already allowed by the store), that
        registry's port — never another service of this machine."""
        if env is None:
            return None
        proxy_port = int(env["HTTPS_PROXY"].rsplit(":", 1)[1])
        forwards = {("127.0.0.1", proxy_port): ("127.0.0.1", proxy_port)}
        if registry is not None and is_loopback(registry.host):
            host = "127.0.0.1" if registry.host.lower() == "localhost" else registry.host
            port = (
                registry.registry.rsplit(":", 1)[1]
                if "]:" in registry.registry
                or (":" in registry.registry and not registry.registry.startswith("["))
                else None
            )
            for p in [int(port)] if port else [443, 80]:
                # only a port that listens now: a closed one stays closed in the
                # namespace (skopeo says "connection refused", not a forwarder's EOF)
                with contextlib.suppress(OSError):
                    socket.create_connection((host, p), timeout=5).close()
                    # the same address in the namespace: [::1] stays [::1]
                    forwards[(host, p)] = (host, p)
        return Jail.open(forwards)

    def _run(self, ref: str, args: list[str], registry: Reference | None = None) -> bytes:
        env = self._env()
        try:
            jail = self._jail(env, registry)
        except OSError as e:
            raise errors.ImageStoreError(ref, f"no network namespace for skopeo: {e}") from e
        if env is not None and jail is None and not self.allow_unprotected_loopback:
            # fail closed: nothing is sent rather than a pull loopback is open to
            raise NoNetworkNamespace(
                ref,
                errors.PUBLIC_MESSAGES["image_store_error"],
                detail="registry access refused: not root, so skopeo gets no network "
                "namespace and loopback would be unprotected "
                "(HEDGEROW_REGISTRY_ALLOW_UNPROTECTED_LOOPBACK=1 accepts that)",
            )
        argv = [self.binary, *args]
        if jail is not None:
            argv = ["nsenter", f"--net=/proc/self/fd/{jail.fd}", *argv]
        try:
            out = subprocess.run(
                argv,
                capture_output=True,
                timeout=TIMEOUT_S,
                check=False,
                env=env,
                pass_fds=(jail.fd,) if jail is not None else (),
            )
        except FileNotFoundError as e:
            raise errors.ImageStoreError(ref, f"{self.binary} is not installed") from e
        except subprocess.TimeoutExpired as e:
            raise errors.RegistryUnreachable(ref, f"no answer within {TIMEOUT_S} s") from e
        finally:
            if jail is not None:
                jail.close()
        if out.returncode != 0:
            raise classify(ref, out.stderr.decode(errors="replace"))
        return out.stdout

    def _tls(self, insecure: bool, flag: str) -> list[str]:
        # --tls-verify=false also lets skopeo fall back to plain HTTP: insecure only
        return [f"{flag}=false"] if insecure else []

    def manifest(self, ref: Reference, what: str, auth: Path, insecure: bool) -> bytes:
        """The raw manifest (or index) bytes the registry serves for what (a transport)."""
        args = ["inspect", "--raw", "--retry-times", str(self.retry_times), "--authfile", str(auth)]
        return self._run(str(ref), args + self._tls(insecure, "--tls-verify") + [what], ref)

    def copy(self, ref: Reference, digest: str, layout: Path, auth: Path, insecure: bool) -> None:
        """Fetch the image manifest digest names into the OCI layout (blobs already
        there are not fetched again)."""
        args = [
            "copy",
            "--quiet",
            "--retry-times",
            str(self.retry_times),
            "--src-authfile",
            str(auth),
            *self._tls(insecure, "--src-tls-verify"),
            ref.with_digest(digest),
            f"oci:{layout}",
        ]
        self._run(str(ref), args, ref)

    def copy_from(self, ref: str, source: str, layout: Path) -> None:
        """Copy a local image (``oci:<dir>``, ``docker-archive:<tar>``) into an OCI
        layout, resolving an index for this platform."""
        try:
            self._run(ref, ["copy", "--quiet", source, f"oci:{layout}"])
        except (
            errors.DigestMismatch,
            errors.DiskExhausted,
            errors.UnsupportedPlatform,
            NoNetworkNamespace,  # not the archive's fault
        ):
            raise
        except errors.ImageError as e:
            # no registry is involved: whatever skopeo says is about the archive
            raise errors.InvalidArchive(
                ref, errors.PUBLIC_MESSAGES["image_archive_invalid"], detail=e.detail
            ) from e
