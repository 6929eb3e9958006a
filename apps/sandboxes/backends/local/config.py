"""Configuration and resource naming for the local backend.

Every name carries the installation's instance id (readable where the kernel
allows long names, hashed where it does not) so two installations on one machine
never see or touch each other's resources.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local.images.egress import RegistryPolicy

ISOLATION_MODES = ("auto", "netns", "none")
# How an isolated sandbox's agent starts: "zygote" forks it from an already-imported
# process (zygote/daemon.py), "exec" runs `python3 -m podagent` as bwrap's payload;
# "auto": zygote when it can be used (gcc builds its pause binary), else exec.
AGENT_LAUNCH_MODES = ("auto", "zygote", "exec")

_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,39}$")
_SANDBOX_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_IMAGE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

AGENT_MOUNT = "/opt/hedgerow/podagent"
BUNDLE_MOUNT = "/opt/hedgerow/bundle"  # scripts/build_agent_bundle.sh output, read-only
SECRET_MOUNT = "/run/hedgerow"


@dataclass(frozen=True)
class LocalBackendConfig:
    state_dir: Path
    instance: str
    podagent_dir: Path  # the project's ``podagent/`` package directory
    subnet: str | None = None  # e.g. "10.213.7.0/24"; None: allocate one in 10.213.0.0/16
    agent_port: int = 7777
    python: str = "/usr/bin/python3"
    # "auto": netns+bwrap when root, else "none" (plain processes on loopback).
    # A str rather than a Literal so settings can pass their value straight in.
    isolation: str = "auto"
    claims_dir: Path = Path("/run/hedgerow/subnets")  # machine-wide subnet claims
    # A self-contained agent bundle (scripts/build_agent_bundle.sh): runs the agent in
    # imported images that have no python3 of their own. None: such images are refused.
    agent_bundle: Path | None = None
    subnet_pool: str = "10.213.0.0/16"
    # The size of the subnet an instance claims from the pool when ``subnet`` is unset,
    # which caps its live sandboxes at 2^(32-prefix) - 3: a /24 holds 253, a /21 2045.
    # `make up` asks for a /21 (HEDGEROW_LOCAL_SUBNET_PREFIX); test instances keep /24s
    # so that many runs share the pool. docs/operations.md "Density"
    subnet_prefix: int = 24
    # Ports per bridge: the subnet is cut into aligned blocks of the largest power of
    # two not above this, one bridge each (network.py). A Linux bridge has at most
    # 1023 (BR_MAX_PORTS); tests make bridges tiny so that a few sandboxes span several.
    bridge_ports: int = 1023
    agent_launch: str = "auto"  # AGENT_LAUNCH_MODES
    # The interpreter the zygote and its agents run (stdlib only: podagent, zygote);
    # None: the control plane's own (sys.executable). docs/local-backend.md
    zygote_python: str | None = None
    # Exec launch (no zygote) lacks the agent's immunity to commands (no uid split, no
    # guard seccomp filter: a command can kill or renice the agent), so an isolated
    # backend that would start agents by exec refuses to provision unless this opt-in
    # is set (single-tenant/dev use). docs/local-backend.md "Commands cannot signal the agent"
    allow_unprotected_exec_launch: bool = False
    # Size of the instance's sandbox storage (storage.py), fixed when it is first
    # created; 0: min(64 GiB, half the free space of the state dir's filesystem).
    disk_size_mib: int = 0
    # OCI images (docs/images.md): the machine-wide content-addressed store, the
    # registry egress policy (images/egress.py; a function: asked at every pull and
    # resolve, so a settings change applies at once; None: public registries only,
    # none over plain HTTP), the free space a pull must leave, and the cache size above
    # which unused images are collected (0: no cap).
    image_store: Path = Path("/var/lib/hedgerow/images")
    registry_policy: Callable[[], RegistryPolicy] | None = None
    image_min_free_bytes: int = 2 << 30
    # not root (no namespace for skopeo, images/jail.py): pull anyway, loopback open
    registry_allow_unprotected_loopback: bool = False
    image_cache_bytes: int = 0
    # Egress allowlists (docs/egress.md): the upstream DNS server the instance's resolver
    # forwards permitted names to ("ip" or "ip:port"; "": the host's first IPv4
    # nameserver), and the seconds an address stays allowed past its record's TTL.
    dns_upstream: str = ""
    dns_grace_s: int = 30
    # Egress "all" (docs/egress.md "Always denied"): the private ranges
    # (egress.PRIVATE_NETWORKS) are refused unless listed here (CIDRs) or, all of them,
    # with egress_allow_private.
    egress_private_allow: tuple[str, ...] = ()
    egress_allow_private: bool = False


def check_instance(instance: str) -> None:
    # Sandbox ids have no dashes, so "hedgerow-<instance>-<sandbox>" parses back
    # unambiguously: instance "a" never lists instance "a-b"'s netns.
    if not _INSTANCE_RE.match(instance):
        raise BackendError(f"invalid instance id {instance!r}: use [A-Za-z0-9_-]{{1,40}}")


def check_sandbox_id(sandbox_id: str) -> None:
    if not _SANDBOX_RE.match(sandbox_id):
        raise BackendError(f"invalid sandbox id {sandbox_id!r}")


def check_image_name(name: str) -> None:
    if not _IMAGE_RE.match(name) or name.startswith("."):
        raise BackendError(f"invalid image name {name!r}")


def _hex(text: str, n: int) -> str:
    # names, not security: short and stable is all that matters
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:n]


@dataclass(frozen=True)
class Names:
    """Deterministic names: destroy can compute them even without meta.json."""

    instance: str

    @property
    def ihash(self) -> str:
        return _hex(self.instance, 10)

    @property
    def bridge(self) -> str:
        return "hb" + self.ihash  # 12 chars (IFNAMSIZ is 16 incl. NUL)

    def bridge_n(self, index: int) -> str:
        """Bridge ``index`` of the instance: the first keeps the historical name, the
        others add three hex digits (15 chars): all match ``bridge + "*"``."""
        return self.bridge if index == 0 else f"{self.bridge}{index:03x}"

    @property
    def nft_table(self) -> str:
        return "hedgerow_" + self.ihash

    @property
    def veth_prefix(self) -> str:
        # host veths start with this so one static bridge rule covers all of them
        return "v" + self.ihash[:4]

    @property
    def netns_prefix(self) -> str:
        return f"hedgerow-{self.instance}-"

    @property
    def cgroup_group(self) -> str:
        return f"hedgerow-{self.instance}"

    def netns(self, sandbox_id: str) -> str:
        return self.netns_prefix + sandbox_id

    def host_veth(self, sandbox_id: str) -> str:
        return self.veth_prefix + _hex(self.instance + sandbox_id, 10)  # 15 chars

    def veth_alias(self, sandbox_id: str) -> str:
        return f"hedgerow:{self.instance}:{sandbox_id}"

    def sandbox_from_netns(self, name: str) -> str | None:
        if not name.startswith(self.netns_prefix):
            return None
        rest = name[len(self.netns_prefix) :]
        return rest if _SANDBOX_RE.match(rest) else None

    def sandbox_from_alias(self, alias: str) -> str | None:
        prefix = f"hedgerow:{self.instance}:"
        if not alias.startswith(prefix):
            return None
        rest = alias[len(prefix) :]
        return rest if _SANDBOX_RE.match(rest) else None
