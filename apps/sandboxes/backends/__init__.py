"""Chooses the configured backend. Callers use ``get_backend()`` and the base types only."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

from apps.sandboxes.backends.base import Backend

if TYPE_CHECKING:
    from apps.sandboxes.backends.local.images.egress import RegistryPolicy, Resolver

# The resolver the registry egress policy asks (None: the host's getaddrinfo). A seam
# for tests, which make names resolve to loopback without /etc/hosts.
REGISTRY_RESOLVER: Resolver | None = None


def registry_policy() -> RegistryPolicy:
    """The registry egress policy from the current settings (docs/security.md
    "Registry egress"): asked by the local backend at every pull and resolve."""
    from apps.sandboxes.backends.local.images.egress import RegistryPolicy, system_resolver

    return RegistryPolicy.of(
        allow=settings.HEDGEROW_REGISTRY_ALLOW,
        insecure=settings.HEDGEROW_INSECURE_REGISTRIES,
        deny=settings.HEDGEROW_REGISTRY_DENY,
        allow_private=settings.HEDGEROW_REGISTRY_ALLOW_PRIVATE,
        resolver=REGISTRY_RESOLVER or system_resolver,
    )


def address_capacity() -> int | None:
    """How many sandboxes the configured backend can hold at once by its addresses, or
    None (no such bound: Kubernetes). The local backend gives each live sandbox one
    address of the instance's subnet (``HEDGEROW_LOCAL_SUBNET``, else a
    /``HEDGEROW_LOCAL_SUBNET_PREFIX`` from the pool): admission counts against it, so a
    burst past it waits in the admission queue instead of failing at provision."""
    if settings.HEDGEROW_BACKEND != "local":
        return None
    # The subnet the instance claimed first is kept (its file in the state dir), even
    # when the settings ask for another size since: that one holds the addresses.
    claimed = Path(settings.STATE_DIR) / "sandboxes" / settings.HEDGEROW_INSTANCE / "subnet"
    try:
        subnet = claimed.read_text().strip()
    except OSError:
        subnet = settings.HEDGEROW_LOCAL_SUBNET
    return _subnet_capacity(subnet, settings.HEDGEROW_LOCAL_SUBNET_PREFIX)


@functools.lru_cache(maxsize=8)
def _subnet_capacity(subnet: str, prefix: int) -> int:
    import ipaddress

    from apps.sandboxes.backends.local.network import usable_addresses

    net = ipaddress.IPv4Network(subnet or f"0.0.0.0/{prefix}")
    return usable_addresses(net)


@functools.cache
def get_backend() -> Backend:
    name = settings.HEDGEROW_BACKEND
    if name == "local":
        from apps.sandboxes.backends.local import LocalBackend, LocalBackendConfig, agent_python

        return LocalBackend(
            LocalBackendConfig(
                state_dir=Path(settings.STATE_DIR) / "sandboxes" / settings.HEDGEROW_INSTANCE,
                instance=settings.HEDGEROW_INSTANCE,
                subnet=settings.HEDGEROW_LOCAL_SUBNET or None,
                subnet_prefix=settings.HEDGEROW_LOCAL_SUBNET_PREFIX,
                bridge_ports=settings.HEDGEROW_LOCAL_BRIDGE_PORTS,
                podagent_dir=Path(settings.BASE_DIR) / "podagent",
                python=settings.HEDGEROW_AGENT_PYTHON,
                isolation=settings.HEDGEROW_LOCAL_ISOLATION,
                agent_launch=settings.HEDGEROW_LOCAL_AGENT_LAUNCH,
                zygote_python=agent_python.resolve(settings.HEDGEROW_LOCAL_ZYGOTE_PYTHON),
                allow_unprotected_exec_launch=settings.HEDGEROW_LOCAL_ALLOW_UNPROTECTED_EXEC_LAUNCH,
                disk_size_mib=settings.HEDGEROW_SANDBOX_DISK_SIZE_MIB,
                image_store=Path(settings.HEDGEROW_IMAGE_STORE),
                registry_policy=registry_policy,
                image_min_free_bytes=settings.HEDGEROW_IMAGE_MIN_FREE_MIB << 20,
                registry_allow_unprotected_loopback=(
                    settings.HEDGEROW_REGISTRY_ALLOW_UNPROTECTED_LOOPBACK
                ),
                image_cache_bytes=settings.HEDGEROW_IMAGE_CACHE_MIB << 20,
                dns_upstream=settings.HEDGEROW_DNS_UPSTREAM,
                dns_grace_s=settings.HEDGEROW_DNS_GRACE_S,
                egress_private_allow=tuple(settings.HEDGEROW_EGRESS_PRIVATE_ALLOW),
                egress_allow_private=settings.HEDGEROW_EGRESS_ALLOW_PRIVATE,
                agent_bundle=Path(settings.HEDGEROW_AGENT_BUNDLE)
                if settings.HEDGEROW_AGENT_BUNDLE
                else None,
            )
        )
    if name == "kubernetes":
        import importlib

        # Imported by name: the kubernetes client is only needed when this backend is chosen.
        module = importlib.import_module("apps.sandboxes.backends.kubernetes")
        backend: Backend = module.build_kubernetes_backend()
        return backend
    raise ValueError(f"unknown HEDGEROW_BACKEND {name!r} (expected local or kubernetes)")
