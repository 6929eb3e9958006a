"""OCI image references: ``[registry/]repository[:tag][@sha256:hex]``, Docker's rules.

Short Docker Hub names are expanded here (``python:3.12`` → ``docker.io/library/
python:3.12``), never through the host's registries.conf short-name aliases, so the
same string means the same image on every machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidReference

DOCKER_HUB = "docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9a-fA-F:]+\])(?::[0-9]{1,5})?$")


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port]
    repository: str
    tag: str | None
    digest: str | None

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s

    def with_digest(self, digest: str) -> str:
        """The transport string skopeo gets to fetch exactly this content."""
        return f"docker://{self.registry}/{self.repository}@{digest}"

    @property
    def transport(self) -> str:
        return f"docker://{self}"

    @property
    def host(self) -> str:
        h = self.registry
        if h.startswith("["):
            return h[1 : h.index("]")]
        return h.rsplit(":", 1)[0] if ":" in h else h


def parse(text: str) -> Reference:
    if not text or len(text) > 512 or text != text.strip():
        raise InvalidReference(text, "not an image reference")
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            raise InvalidReference(text, "digest must be sha256:<64 hex>")
    first, _, remainder = rest.partition("/")
    if remainder and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
        if not _HOST.match(registry):
            raise InvalidReference(text, f"bad registry host {registry!r}")
    else:
        registry, path = DOCKER_HUB, rest
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.match(tag):
            raise InvalidReference(text, f"bad tag {tag!r}")
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not _REPO.match(path):
        raise InvalidReference(text, f"bad repository name {path!r}")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, path, tag, digest)
