"""The control plane's registry egress policy: which registries skopeo may be pointed at.

A tenant names the registry in its image reference, and the control plane's skopeo
connects to it from the control plane's own network position. Without a policy that is
a server-side request forgery: loopback services, the cloud metadata address
(169.254.169.254), private ranges and internal hosts. The rule (docs/security.md
"Registry egress"):

* a registry the operator **denies** (``deny``: ``host`` or ``host:port``) is refused;
* a registry the operator **lists** (``allow``, or ``insecure`` for plain HTTP) is
  allowed whatever its addresses;
* otherwise its host — an IP literal, or **every** address the name resolves to, asked
  again at each check (no cache: a name that rebinds to 127.0.0.1 between two pulls is
  refused at the second) — must be a public unicast address: loopback, link-local,
  private, CGNAT (100.64/10), unique-local (fc00::/7), multicast, unspecified,
  reserved and documentation ranges are refused (``allow_private`` turns this off);
* plain HTTP (and unverified TLS) only for the ``insecure`` list: no host is implied,
  not even loopback.

A refusal is :class:`~.errors.RegistryForbidden` (``registry_forbidden``) with a fixed
message; the addresses that caused it are in ``detail`` for the operator's log only.
The resolver is a plain function so tests (and operators with their own resolution)
inject one. Plain Python, no Django, like the rest of the local backend.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from . import errors
from .reference import Reference

Resolver = Callable[[str], list[str]]  # host name → every address it resolves to

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")


def system_resolver(host: str) -> list[str]:
    """Every address ``host`` resolves to through the host's resolver (getaddrinfo)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def public_address(address: str) -> bool:
    """True only for a globally routable unicast address. IPv4 mapped into IPv6
    (``::ffff:a.b.c.d``) and NAT64 (``64:ff9b::a.b.c.d``) are judged by their IPv4."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.is_multicast or ip.is_unspecified or ip.is_loopback or ip.is_link_local:
        return False
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return False
    return bool(ip.is_global)


def _entries(values: Iterable[str]) -> frozenset[str]:
    return frozenset(v.strip().lower() for v in values if v.strip())


@dataclass(frozen=True)
class RegistryPolicy:
    allow: frozenset[str] = frozenset()  # host or host:port, allowed whatever they resolve to
    insecure: frozenset[str] = frozenset()  # plain HTTP / unverified TLS (implies allowed)
    deny: frozenset[str] = frozenset()  # always refused, checked first
    allow_private: bool = False  # operator escape hatch: no address check
    resolver: Resolver = field(default=system_resolver, compare=False)

    @staticmethod
    def of(
        *,
        allow: Iterable[str] = (),
        insecure: Iterable[str] = (),
        deny: Iterable[str] = (),
        allow_private: bool = False,
        resolver: Resolver = system_resolver,
    ) -> RegistryPolicy:
        return RegistryPolicy(
            _entries(allow), _entries(insecure), _entries(deny), allow_private, resolver
        )

    @staticmethod
    def _names(ref: Reference) -> tuple[str, str]:
        return ref.registry.lower(), ref.host.lower()

    def _listed(self, entries: frozenset[str], ref: Reference) -> bool:
        """An entry ``host:port`` matches that port only; ``host`` matches any port."""
        registry, host = self._names(ref)
        return registry in entries or host in entries

    def plain_http(self, ref: Reference) -> bool:
        """Plain HTTP and unverified TLS: only for registries in ``insecure``."""
        return self._listed(self.insecure, ref) and not self._listed(self.deny, ref)

    def check(self, ref: Reference) -> None:
        """Raises RegistryForbidden unless skopeo may contact ``ref``'s registry now;
        RegistryUnreachable when its name does not resolve. Resolves on every call."""
        self.addresses(ref)

    def addresses(self, ref: Reference) -> list[str]:
        """``check``, returning the addresses it checked (to connect to exactly those:
        the proxy) — empty when the registry is listed or the address check is off
        (connect by name then)."""
        if self._listed(self.deny, ref):
            raise errors.RegistryForbidden(
                str(ref), errors.PUBLIC_MESSAGES["registry_forbidden"], detail="on the deny list"
            )
        if self._listed(self.allow, ref) or self._listed(self.insecure, ref):
            return []
        if self.allow_private:
            return []
        host = ref.host
        try:
            addresses = [str(ipaddress.ip_address(host))]
        except ValueError:
            try:
                addresses = list(self.resolver(host))
            except (OSError, UnicodeError) as exc:
                raise errors.RegistryUnreachable(
                    str(ref), errors.PUBLIC_MESSAGES["registry_unreachable"], detail=str(exc)
                ) from exc
        if not addresses:
            raise errors.RegistryUnreachable(
                str(ref), errors.PUBLIC_MESSAGES["registry_unreachable"], detail="no address"
            )
        refused = []
        for address in addresses:
            try:
                if not public_address(address):
                    refused.append(address)
            except ValueError:
                refused.append(address)  # a resolver answering garbage is not trusted
        if refused:
            raise errors.RegistryForbidden(
                str(ref),
                errors.PUBLIC_MESSAGES["registry_forbidden"],
                detail=f"{host} resolves to non-public {', '.join(refused)}",
            )
        return addresses
