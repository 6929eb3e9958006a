"""A sandbox's egress policy: parsed, validated and in one canonical form.

Plain Python (no Django): the control plane validates and stores it, the backends
enforce it. Three shapes (docs/egress.md):

* ``"none"`` (the default): no network beyond the control plane's connection to the
  agent;
* ``"all"``: what ``network_access: true`` always meant (routed, masqueraded; still
  never the host, other sandboxes or link-local addresses);
* ``{"allow": [...], "dns": "filtered"}``: only what the list names. An entry is a
  host name (``pkg.example.org``), a wildcard (``*.git.example.com``: any name below
  it, not the name itself) or an IPv4 address or CIDR with a TCP port
  (``10.20.0.0/16:443``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

MAX_ALLOW = 64
DNS_MODES = ("filtered",)
# "ip": an address handed out for an allowed name is open on every TCP port; "sni":
# on 443/80 the TLS SNI / HTTP Host of each connection must be an allowed name too.
MATCH_MODES = ("ip", "sni")

# Never reachable whatever the policy says: listing one of these is an error rather
# than a rule that silently does nothing.
FORBIDDEN_NETWORKS = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "127.0.0.0/8",
        "169.254.0.0/16",  # link-local, cloud metadata (169.254.169.254)
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, broadcast
    )
)

# Denied to egress "all" unless the operator allows them (docs/egress.md "Always
# denied"): the installation's likely neighbours — private (RFC 1918), CGNAT, the IETF
# protocol block and the benchmarking range. An allowlist reaches a private range only
# by listing it (CIDR:port).
PRIVATE_NETWORKS = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",  # carrier-grade NAT
        "192.0.0.0/24",  # IETF protocol assignments
        "198.18.0.0/15",  # benchmarking
    )
)

_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_NAME_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})+$")


class EgressError(ValueError):
    """A policy that cannot be accepted; ``code`` is the machine-readable reason."""

    def __init__(self, message: str, code: str = "invalid_egress") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class CidrRule:
    network: ipaddress.IPv4Network
    port: int

    def __str__(self) -> str:
        net = (
            str(self.network.network_address) if self.network.prefixlen == 32 else str(self.network)
        )
        return f"{net}:{self.port}"


@dataclass(frozen=True)
class EgressPolicy:
    mode: str  # "none" | "all" | "allow"
    names: tuple[str, ...] = ()  # exact names and "*.suffix" wildcards, lowercase
    cidrs: tuple[CidrRule, ...] = ()
    dns: str = "filtered"
    match: str = "ip"

    @property
    def routed(self) -> bool:
        """Whether the sandbox gets a route out at all."""
        return self.mode != "none"

    def to_json(self) -> str | dict[str, Any]:
        if self.mode != "allow":
            return self.mode
        out: dict[str, Any] = {
            "allow": [*self.names, *(str(c) for c in self.cidrs)],
            "dns": self.dns,
        }
        if self.match != "ip":
            out["match"] = self.match
        return out

    def allows_name(self, name: str) -> bool:
        """Whether DNS may resolve ``name`` (a query name; case and a final dot ignored)."""
        if self.mode == "all":
            return True
        if self.mode != "allow":
            return False
        name = name.lower().rstrip(".")
        for pattern in self.names:
            if pattern.startswith("*."):
                if name.endswith(pattern[1:]) and len(name) > len(pattern) - 1:
                    return True
            elif name == pattern:
                return True
        return False


NONE = EgressPolicy("none")
ALL = EgressPolicy("all")


def parse_egress(value: Any) -> EgressPolicy:
    """The policy ``value`` denotes, or an ``EgressError`` naming what is wrong."""
    if value is None or value == "none":
        return NONE
    if value == "all":
        return ALL
    if isinstance(value, str):
        raise EgressError(f"egress must be 'none', 'all' or an object with 'allow', not {value!r}")
    if not isinstance(value, dict):
        raise EgressError("egress must be 'none', 'all' or an object with 'allow'")
    unknown = sorted(set(value) - {"allow", "dns", "match"})
    if unknown:
        raise EgressError(f"unknown egress key(s): {', '.join(map(str, unknown))}")
    dns = value.get("dns", "filtered")
    if dns not in DNS_MODES:
        raise EgressError(f"egress.dns must be one of {', '.join(DNS_MODES)}, not {dns!r}")
    match = value.get("match", "ip")
    if match not in MATCH_MODES:
        raise EgressError(f"egress.match must be one of {', '.join(MATCH_MODES)}, not {match!r}")
    allow = value.get("allow")
    if not isinstance(allow, list) or not allow:
        raise EgressError("egress.allow must be a non-empty list of names or CIDR:port")
    if len(allow) > MAX_ALLOW:
        raise EgressError(f"egress.allow has at most {MAX_ALLOW} entries", code="too_many")
    names: list[str] = []
    cidrs: list[CidrRule] = []
    for entry in allow:
        if not isinstance(entry, str):
            raise EgressError(f"egress.allow entries are strings, not {entry!r}")
        item = entry.strip().lower()
        if item and (item[0].isdigit() or "/" in item or ":" in item):
            rule = _parse_cidr(entry, item)
            if rule not in cidrs:
                cidrs.append(rule)
        else:
            name = _parse_name(entry, item)
            if name not in names:
                names.append(name)
    return EgressPolicy("allow", tuple(names), tuple(cidrs), dns, match)


def _parse_name(entry: str, item: str) -> str:
    bare = item[2:] if item.startswith("*.") else item
    if len(bare) > 253 or not _NAME_RE.match(bare):
        raise EgressError(f"{entry!r} is not a host name (a.b.c), a wildcard (*.b.c) or CIDR:port")
    if bare.replace(".", "").isdigit():
        raise EgressError(f"{entry!r}: an address needs a port (1.2.3.4:443)")
    return item


def _parse_cidr(entry: str, item: str) -> CidrRule:
    net_text, sep, port_text = item.rpartition(":")
    if not sep:
        raise EgressError(f"{entry!r}: an address or CIDR needs a port (10.0.0.0/8:443)")
    if ":" in net_text:
        raise EgressError(f"{entry!r}: sandboxes have IPv4 only")
    try:
        network = ipaddress.IPv4Network(net_text, strict=True)
    except ValueError as exc:
        raise EgressError(f"{entry!r}: {exc}") from None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise EgressError(f"{entry!r}: the port must be 1-65535")
    if network.prefixlen < 8:
        raise EgressError(f"{entry!r}: a CIDR wider than /8 is not an allowlist")
    for forbidden in FORBIDDEN_NETWORKS:
        if network.overlaps(forbidden):
            raise EgressError(
                f"{entry!r} overlaps {forbidden}, which sandboxes can never reach",
                code="forbidden_address",
            )
    return CidrRule(network, int(port_text))


def uncovered(policy: EgressPolicy, allowed: EgressPolicy) -> list[str]:
    """The entries of ``policy`` that ``allowed`` (a tenant's permitted patterns) does not
    cover: a name by the same name or a wildcard above it (``*.example.org`` covers
    ``pkg.example.org`` and ``*.git.example.org``), a CIDR:port by a CIDR holding it with
    the same port. ``"all"`` is judged by the caller (``egress_allow_all``)."""
    if policy.mode != "allow":
        return []
    out = []
    for name in policy.names:
        bare = name[2:] if name.startswith("*.") else name
        if not any(
            name == p or (p.startswith("*.") and bare.endswith(p[1:])) for p in allowed.names
        ):
            out.append(name)
    for rule in policy.cidrs:
        if not any(
            rule.port == q.port and rule.network.subnet_of(q.network) for q in allowed.cidrs
        ):
            out.append(str(rule))
    return out
