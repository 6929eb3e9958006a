"""Bridge, subnet and address claims, per-sandbox netns + veth, nftables.

Isolation model (see docs/local-backend.md):
* inside each netns: no default route and an output policy-drop table, loaded
  before the agent starts (stateless without network access: the agent's port to
  and from the gateway; with it, replies pass as established); no IPv6 but on lo;
* host table ``inet hedgerow_<hash>``: nothing from the bridge may open a
  connection to the host; forwarding only for sandboxes in the ``egress`` set;
* host table ``bridge hedgerow_<hash>`` plus bridge port isolation: no frame is
  bridged from one sandbox port to another.

An instance's subnet is cut into aligned blocks of at most ``bridge_ports`` addresses
(512 by default), one bridge each: a Linux bridge holds at most 1023 ports. Every
bridge has the gateway's MAC; the first holds the gateway's address (and the
subnet's connected route), each other one a route to its block with the gateway as
source. Host rules match every bridge of the instance by name prefix, so a packet
from one bridge to another is routed traffic the forward chain drops.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from apps.core.egress import FORBIDDEN_NETWORKS, PRIVATE_NETWORKS, EgressPolicy
from apps.sandboxes.backends.base import BackendError

from . import _netlink, _nft, idmap
from ._netlink import (
    IFLA_ADDRESS,
    IFLA_IFALIAS,
    IFLA_IFNAME,
    IFLA_MASTER,
    IFLA_NET_NS_FD,
    NETNS_DIR,
    Rtnl,
    attr,
    attr_str,
    attr_u32,
    bridge_port_isolated,
    ifinfo,
    in_new_netns,
    link_index,
    mac_bytes,
)
from ._sys import run
from .config import LocalBackendConfig, Names

log = logging.getLogger(__name__)

# The instance resolver's SNI/Host check (resolver.py) on the gateway: an allowlist
# with "match": "sni" has its connections to resolved addresses on 80/443 sent here.
SNI_PORT = 15380


# A Linux bridge numbers its ports in 10 bits and port 0 is reserved (BR_MAX_PORTS in
# net/bridge/br_private.h): the 1024th veth is refused with EXFULL. So an instance
# spreads its sandboxes over several bridges (one per block of its subnet).
BRIDGE_MAX_PORTS = 1023


def usable_addresses(net: ipaddress.IPv4Network) -> int:
    """Sandbox addresses an instance can hand out: the subnet's, less the network, the
    gateway and the broadcast address (no bridge holds more than its ports: blocks)."""
    return max(0, net.num_addresses - 3)


def capacity_reason(net: ipaddress.IPv4Network) -> str:
    return f"a /{net.prefixlen}; a larger one: HEDGEROW_LOCAL_SUBNET_PREFIX"


def block_prefix(net: ipaddress.IPv4Network, bridge_ports: int) -> int:
    """The prefix of the blocks ``net`` is cut into, one bridge each: the largest power
    of two of addresses not above ``bridge_ports`` (512 for 1023), at most ``net``."""
    if not 1 <= bridge_ports <= BRIDGE_MAX_PORTS:
        raise BackendError(
            f"bridge_ports={bridge_ports}: a Linux bridge holds 1 to {BRIDGE_MAX_PORTS} ports"
        )
    return max(net.prefixlen, 33 - bridge_ports.bit_length())


class Network:
    def __init__(self, config: LocalBackendConfig, names: Names) -> None:
        self.config = config
        self.names = names
        self.addr_dir = config.state_dir / "addresses"
        self.subnet_file = config.state_dir / "subnet"
        self._subnet: ipaddress.IPv4Network | None = None
        self._cursor = 0  # where claim_ip looks first (a hint; the claim files decide)
        self._tables_current = False  # the inet table has this version's sets and rules
        self._bridges_ready: set[int] = set()  # bridges this process has seen routed

    # ---- instance-wide -------------------------------------------------------------

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            self._subnet = self._claim_subnet()
        return self._subnet

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def bridge_mac(self) -> str:
        return _mac_for(self.gateway)

    # ---- bridges: one per aligned block of the subnet --------------------------------

    def bridge_index(self, ip: str) -> int:
        offset = int(ipaddress.IPv4Address(ip)) - int(self.subnet.network_address)
        if not 0 <= offset < self.subnet.num_addresses:
            raise BackendError(f"{ip} is not in the instance subnet {self.subnet}")
        return offset >> (32 - block_prefix(self.subnet, self.config.bridge_ports))

    def bridge_of(self, ip: str) -> str:
        """The bridge whose port a sandbox with address ``ip`` is."""
        return self.names.bridge_n(self.bridge_index(ip))

    def _bridges_holding(self, ip: str) -> list[str]:
        """Where ``ip``'s neighbour entry can be: its block's bridge, and the first one
        (a one-bridge layout put every sandbox there: _adopt_strays); for an address
        outside the subnet (an entry left from a subnet this instance held before),
        every bridge of the instance."""
        if ipaddress.IPv4Address(ip) in self.subnet:
            return sorted({self.bridge_of(ip), self.names.bridge})
        return self.bridges()

    def block(self, index: int) -> ipaddress.IPv4Network:
        prefix = block_prefix(self.subnet, self.config.bridge_ports)
        first = int(self.subnet.network_address) + (index << (32 - prefix))
        return ipaddress.IPv4Network((first, prefix))

    def bridges(self) -> list[str]:
        """This instance's bridges that exist (the first one first)."""
        base = self.names.bridge
        try:
            links = os.listdir("/sys/class/net")
        except OSError as exc:
            raise BackendError(f"cannot list links: {exc}") from exc
        found = [n for n in links if n == base or (n.startswith(base) and len(n) == len(base) + 3)]
        return sorted(found, key=lambda n: (len(n), n))

    def _ensure_bridge(self, rt: Rtnl, index: int) -> int:
        """ifindex of bridge ``index``, created (gateway MAC, no IPv6, up, its block's
        route) when missing. Bridge 0 is ensure_instance's."""
        name = self.names.bridge_n(index)
        found = link_index(name)
        if index == 0:
            if not found:
                raise OSError(f"bridge {name} is missing")
            return found
        if found and index in self._bridges_ready:
            return found
        if not found:
            try:
                rt.add_bridge(name, self.bridge_mac)
            except _netlink.NetlinkError as exc:
                if exc.errno != errno.EEXIST:  # another process made it meanwhile
                    raise
            _disable_ipv6(name)
        rt.set_link(name, up=True)
        found = link_index(name)
        block = self.block(index)
        self._adopt_strays(rt, block, found)
        rt.replace_link_route(str(block.network_address), block.prefixlen, found, self.gateway)
        self._bridges_ready.add(index)
        return found

    def _adopt_strays(self, rt: Rtnl, block: ipaddress.IPv4Network, bridge: int) -> None:
        """Live sandboxes that a one-bridge layout (an older version, or a larger
        ``bridge_ports``) put on the first bridge with an address of ``block`` move to
        ``block``'s bridge before its route takes their traffic: port, forwarding entry,
        isolation and neighbour entry. Their side does not change (every bridge has the
        gateway's MAC). Only when a bridge is first set up in this process."""
        first = self.names.bridge
        base = link_index(first)
        if not base:
            return
        out = run(["ip", "-j", "-4", "neigh", "show", "dev", first, "nud", "permanent"])
        strays = [
            n["dst"]
            for n in json.loads(out.stdout or "[]")
            if n.get("dst") and ipaddress.IPv4Address(n["dst"]) in block
        ]
        owners = dict(self.claims()) if strays else {}
        for ip in strays:
            owner = owners.get(ip)
            hv = self.names.host_veth(owner) if owner else ""
            if not owner or not link_index(hv):
                continue  # a stale entry: the reconciler's to reclaim
            log.info("moving sandbox %s (%s) to bridge %d of its block", owner, ip, bridge)
            rt.set_link(hv, attr_u32(IFLA_MASTER, bridge))
            rt.set_fdb_static(link_index(hv), _mac_for(ip))
            rt.set_link(hv, bridge_port_isolated(), up=True)
            rt.set_neigh(bridge, ip, _mac_for(ip))
            rt.del_neigh(base, ip)

    def _claim_file(self, net: ipaddress.IPv4Network) -> Path:
        return self.config.claims_dir / str(net.network_address)

    def _try_claim(self, net: ipaddress.IPv4Network) -> bool:
        owner = f"{self.config.instance} {self.config.state_dir}\n"
        path = self._claim_file(net)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                return path.read_text() == owner
            except OSError:
                return False
        with os.fdopen(fd, "w") as f:
            f.write(owner)
        return True

    def _claim_subnet(self) -> ipaddress.IPv4Network:
        self.config.claims_dir.mkdir(parents=True, exist_ok=True)
        if self.subnet_file.exists():
            net = ipaddress.IPv4Network(self.subnet_file.read_text().strip())
            if not self._try_claim(net):
                raise BackendError(f"subnet {net} of this instance is claimed by another")
            return net
        if self.config.subnet:
            candidates = [ipaddress.IPv4Network(self.config.subnet)]
        else:
            pool = ipaddress.IPv4Network(self.config.subnet_pool)
            prefix = self.config.subnet_prefix
            if not pool.prefixlen <= prefix <= 28:
                raise BackendError(
                    f"HEDGEROW_LOCAL_SUBNET_PREFIX={prefix}: must be between the pool's "
                    f"/{pool.prefixlen} ({pool}) and /28"
                )
            candidates = list(pool.subnets(new_prefix=prefix))
        used = self._routed_networks()
        for net in candidates:
            if any(net.overlaps(u) for u in used):
                continue
            if not idmap.blocks_free(self.config.claims_dir, net):
                continue  # its sandboxes' uid ranges are another subnet's (idmap.py)
            if self._try_claim(net):
                self.subnet_file.write_text(f"{net}\n")
                return net
        raise BackendError(
            f"no free /{self.config.subnet_prefix} left in {self.config.subnet_pool} for this "
            "instance (other instances hold the rest: `python -m apps.sandboxes.backends.local.gc` "
            "frees what dead ones left; or set HEDGEROW_LOCAL_SUBNET)"
        )

    def _routed_networks(self) -> list[ipaddress.IPv4Network]:
        out = run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout
        nets = []
        for route in json.loads(out or "[]"):
            dst = route.get("dst", "")
            if dst and dst != "default" and not route.get("dev", "").startswith(self.names.bridge):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.IPv4Network(dst, strict=False))
        return [n for n in nets if n.prefixlen > 0]

    def ensure_instance(self) -> None:
        """Create the bridge and host tables if missing (caller holds the instance lock).

        Runs before every provision, so a bridge or table deleted by hand comes back;
        in-process (netlink, libnftables) it costs well under a millisecond.
        """
        br, gw = self.names.bridge, self.gateway
        try:
            with Rtnl() as rt:
                if not link_index(br):
                    rt.add_bridge(br, self.bridge_mac)
                elif _link_mac(br) != self.bridge_mac:
                    # A bridge made before its MAC was fixed. Every sandbox gets a
                    # permanent neighbour entry for the gateway with this MAC. (A MAC
                    # change flushes the bridge's neighbour entries, permanent ones
                    # too: once, and they are all dynamic ones of such a bridge.)
                    rt.set_link(br, attr(IFLA_ADDRESS, mac_bytes(self.bridge_mac)))
                rt.add_addr(link_index(br), gw, self.subnet.prefixlen, replace=True)
                rt.set_link(br, up=True)
            with _nft.NfNetlink() as nfnl:
                missing = [
                    ruleset
                    for family, ruleset in self._host_rulesets().items()
                    if not nfnl.table_exists(family, self.names.nft_table)
                ]
            if missing:
                _nft.host_run("".join(missing))
                # a recreated table's sets are empty: without its private ranges
                # egress "all" would reach them (docs/egress.md "Always denied")
                self._tables_current = False
            if not self._tables_current:
                self._upgrade_inet_table()
                self._fill_private_sets()
                self._tables_current = True
        except (OSError, _nft.NftError) as exc:
            raise BackendError(f"cannot set up bridge {br} and host tables: {exc}") from exc

    def _upgrade_inet_table(self) -> None:
        """A host table made by an older version (without egress allowlists' sets, or
        whose rules match one bridge by its exact name) gets the current sets and rules
        in one transaction: chains flushed and refilled, existing sets (the live
        sandboxes' ``egress`` elements) kept. Once per process; a current table costs
        one listing."""
        t = self.names.nft_table
        try:
            _nft.host_run(f"list set inet {t} private_deny")
            if f'"{self.names.bridge}*"' in _nft.host_run(f"list chain inet {t} forward"):
                return
        except _nft.NftError as exc:
            if "No such file" not in str(exc):
                raise
        log.info("upgrading host table inet %s to the current rules", t)
        chains = ("prerouting", "input", "forward", "postrouting")
        _nft.host_run(
            f"add chain inet {t} prerouting {{ type nat hook prerouting priority -100; "
            "policy accept; }\n"
            + "".join(f"flush chain inet {t} {c}\n" for c in chains)
            + self._host_rulesets()["inet"]
        )

    def private_ranges(self) -> tuple[list[str], list[str]]:
        """(denied, allowed) to egress "all": PRIVATE_NETWORKS (none with
        ``egress_allow_private``) and the operator's ``egress_private_allow``."""
        denied = [] if self.config.egress_allow_private else [str(n) for n in PRIVATE_NETWORKS]
        allowed = [str(ipaddress.IPv4Network(n)) for n in self.config.egress_private_allow]
        return denied, allowed

    def _fill_private_sets(self) -> None:
        """The private ranges as this process's configuration says (once per process:
        an operator's change applies when the control plane restarts)."""
        t = self.names.nft_table
        denied, allowed = self.private_ranges()
        script = f"flush set inet {t} private_deny\nflush set inet {t} private_allow\n"
        if denied:
            script += f"add element inet {t} private_deny {{ {', '.join(denied)} }}\n"
        if allowed:
            script += f"add element inet {t} private_allow {{ {', '.join(allowed)} }}\n"
        _nft.host_run(script)

    def _host_rulesets(self) -> dict[str, str]:
        # every bridge of the instance (bridge_n): one name prefix
        br, t, sub = f"{self.names.bridge}*", self.names.nft_table, self.subnet
        gw = self.gateway
        forbidden = ", ".join(str(n) for n in FORBIDDEN_NETWORKS)
        # egress: sandboxes with egress "all"; allowlisted: those with an allowlist,
        # whose packets pass only to allow_dst (sandbox . address the resolver handed
        # out, with its TTL) and allow_net (sandbox . CIDR . TCP port from the policy)
        inet = f"""
table inet {t} {{
  set egress {{ type ipv4_addr; }}
  set allowlisted {{ type ipv4_addr; }}
  set allow_dst {{ type ipv4_addr . ipv4_addr; flags timeout; }}
  set allow_net {{ type ipv4_addr . ipv4_addr . inet_service; flags interval; }}
  set sni_match {{ type ipv4_addr; }}
  set private_deny {{ type ipv4_addr; flags interval; }}
  set private_allow {{ type ipv4_addr; flags interval; }}
  chain prerouting {{
    type nat hook prerouting priority -100; policy accept;
    iifname "{br}" ip saddr @sni_match ip saddr . ip daddr @allow_dst tcp dport {{ 80, 443 }} \\
      dnat ip to {gw}:{SNI_PORT}
  }}
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname "{br}" ct state established,related accept
    iifname "{br}" ip daddr {gw} udp dport 53 ip saddr @egress accept
    iifname "{br}" ip daddr {gw} tcp dport 53 ip saddr @egress accept
    iifname "{br}" ip daddr {gw} udp dport 53 ip saddr @allowlisted accept
    iifname "{br}" ip daddr {gw} tcp dport 53 ip saddr @allowlisted accept
    iifname "{br}" ip daddr {gw} tcp dport {SNI_PORT} ip saddr @sni_match accept
    iifname "{br}" drop
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "{br}" oifname "{br}" drop
    iifname "{br}" ip daddr {{ {forbidden} }} drop
    iifname "{br}" ip saddr @egress ip daddr @private_allow ip daddr != {sub} accept
    iifname "{br}" ip saddr @egress ip daddr @private_deny reject with icmpx type admin-prohibited
    iifname "{br}" ip saddr @egress ip daddr != {sub} accept
    iifname "{br}" meta l4proto tcp ip saddr . ip daddr @allow_dst accept
    iifname "{br}" ip saddr . ip daddr . tcp dport @allow_net accept
    iifname "{br}" ip saddr @allowlisted reject with icmpx type admin-prohibited
    iifname "{br}" drop
    oifname "{br}" ct state established,related accept
    oifname "{br}" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr @egress oifname != "{br}" masquerade
    ip saddr @allowlisted oifname != "{br}" masquerade
  }}
}}
"""
        bridge = f"""
table bridge {t} {{
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "{self.names.veth_prefix}*" drop
    oifname "{self.names.veth_prefix}*" drop
  }}
}}
"""
        return {"inet": inet, "bridge": bridge}

    def teardown_instance(self) -> None:
        for family in ("inet", "bridge"):
            with contextlib.suppress(_nft.NftError):
                _nft.host_run(f"delete table {family} {self.names.nft_table}")
        with contextlib.suppress(OSError), Rtnl() as rt:
            for name in reversed(self.bridges()):  # their routes go with them
                rt.del_link(name)
        self._bridges_ready.clear()
        if self.subnet_file.exists():
            net = ipaddress.IPv4Network(self.subnet_file.read_text().strip())
            path = self._claim_file(net)
            with contextlib.suppress(OSError):
                if path.read_text().startswith(f"{self.config.instance} "):
                    path.unlink()
            self.subnet_file.unlink()
        self._subnet = None

    # ---- addresses -------------------------------------------------------------------

    def claim_ip(self, sandbox_id: str) -> str:
        """Claim a free address (an O_EXCL file naming the sandbox).

        The scan starts after this process's last claim, not at the bottom of the
        subnet: with hundreds of live sandboxes a claim is one or two ``open`` calls
        instead of one per live sandbox, and a released address is reused as late as
        possible. The files alone are the truth; the cursor is only where to look.
        """
        self.addr_dir.mkdir(parents=True, exist_ok=True)
        net = self.subnet
        first = int(net.network_address) + 2  # .1 is the bridge
        count = usable_addresses(net)
        for step in range(max(count, 0)):
            offset = (self._cursor + step) % count
            host = str(ipaddress.IPv4Address(first + offset))
            try:
                fd = os.open(self.addr_dir / host, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(sandbox_id)
            self._cursor = offset + 1
            return host
        raise BackendError(
            f"no free address in the instance subnet {net}: this instance holds at most "
            f"{max(count, 0)} live sandboxes ({capacity_reason(net)}; docs/operations.md "
            '"Density")',
            transient=True,
        )

    def claims(self) -> list[tuple[str, str]]:
        """(ip, sandbox_id) of every address claim."""
        try:
            files = sorted(self.addr_dir.iterdir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise BackendError(f"cannot list address claims: {exc}") from exc
        found = []
        for f in files:
            if f.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                found.append((f.name, f.read_text().strip()))
        return found

    def release_ips(self, sandbox_id: str, known_ip: str | None = None) -> None:
        """Release every address ``sandbox_id`` holds.

        ``known_ip``: the address its meta.json records. A sandbox holds at most that
        one (the claim is recorded in meta.json right after it is made, and every
        provision first destroys what a previous one left), so it is released
        without reading every claim; without it, all claims are read.
        """
        if known_ip is not None:
            try:
                owner = (self.addr_dir / known_ip).read_text().strip()
            except FileNotFoundError:
                return
            if owner == sandbox_id:
                self.release_ip(known_ip)
                return
        for ip, owner in self.claims():
            if owner == sandbox_id:
                self.release_ip(ip)

    def release_ip(self, ip: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.addr_dir / ip).unlink()

    # ---- per sandbox -----------------------------------------------------------------

    def create(
        self,
        sandbox_id: str,
        ip: str,
        policy: EgressPolicy,
        hook: Callable[[str], None],
    ) -> None:
        """netns with its filter, veth pair into it, address, route, egress elements.

        All in-process: netlink for links and addresses, libnftables for rules.
        """
        ns, hv = self.names.netns(sandbox_id), self.names.host_veth(sandbox_id)
        network_access = policy.routed
        ruleset = self._sandbox_ruleset(network_access)

        def inside(rt: Rtnl) -> None:
            # the filter is in place before any interface is up or process exists
            with _nft.Nft() as nft:
                nft.run(ruleset)
            # eth0 (created below) gets no IPv6; lo, made with the netns, keeps ::1
            _disable_ipv6("default")
            rt.set_link("lo", up=True)

        try:
            ns_rt, _ = in_new_netns(ns, inside)
        except (OSError, _nft.NftError) as exc:
            raise BackendError(f"cannot create netns {ns}: {exc}") from exc
        with ns_rt:
            hook("netns_created")
            try:
                self._add_veth(sandbox_id, ip)
            except OSError as exc:
                raise BackendError(f"cannot create veth {hv}: {exc}") from exc
            hook("veth_created")
            try:
                eth0 = ns_rt.index_of("eth0")
                ns_rt.add_addr(eth0, ip, self.subnet.prefixlen)
                # the gateway's entry, like the host's for the sandbox: no ARP either
                # way, and neither counts against the neighbour table's gc_thresh3
                # (the table is machine-wide: every netns's entries count)
                ns_rt.set_neigh(eth0, self.gateway, self.bridge_mac)
                ns_rt.set_link("eth0", up=True)
                if network_access:
                    ns_rt.add_default_route(self.gateway)
            except OSError as exc:
                raise BackendError(f"cannot configure eth0 in {ns}: {exc}") from exc
        if network_access:
            _enable_forwarding()
            self.apply_policy(ip, policy, None)

    def set_routed(self, sandbox_id: str, routed: bool) -> None:
        """A running sandbox's netns gets the routed (stateful) or the closed
        (stateless) table and its default route, or loses it: one nft transaction
        replaces the table, so nothing passes in between that neither allows."""
        ns = self.names.netns(sandbox_id)
        ruleset = self._sandbox_ruleset(routed)
        run(
            ["ip", "netns", "exec", ns, "nft", "-f", "-"],
            input="table inet hedgerow {}\ndelete table inet hedgerow\n" + ruleset,
        )
        if routed:
            _enable_forwarding()
            run(["ip", "-n", ns, "route", "replace", "default", "via", self.gateway])
        else:
            run(["ip", "-n", ns, "route", "del", "default"], check=False)

    def apply_policy(self, ip: str, policy: EgressPolicy, old: EgressPolicy | None) -> None:
        """The host elements for ``ip`` under ``policy`` (replacing ``old``'s).

        "all": ``ip`` in ``egress``; an allowlist: ``ip`` in ``allowlisted`` and one
        ``allow_net`` element per CIDR:port (names reach ``allow_dst`` through the
        resolver). The sandbox's own netns is routed for both (``create``).
        """
        t = self.names.nft_table
        try:
            if old is not None and old.mode != "none":
                self.delete_egress(ip)
                self.delete_allowlist(ip, old)
            elif old is None and policy.mode == "allow":
                # a fresh address: nothing a lost sandbox left on it may carry over
                self.delete_allowlist(ip, None)
            if policy.mode == "all":
                with _nft.NfNetlink() as nfnl:
                    nfnl.set_element("inet", t, "egress", ip, add=True)
            elif policy.mode == "allow":
                cmds = [f"add element inet {t} allowlisted {{ {ip} }}"]
                if policy.match == "sni":
                    cmds.append(f"add element inet {t} sni_match {{ {ip} }}")
                cmds += [
                    f"add element inet {t} allow_net {{ {ip} . {c.network} . {c.port} }}"
                    for c in policy.cidrs
                ]
                _nft.host_run("\n".join(cmds) + "\n")
        except (OSError, _nft.NftError) as exc:
            raise BackendError(f"cannot set the egress policy of {ip}: {exc}") from exc

    def delete_allowlist(self, ip: str, policy: EgressPolicy | None) -> None:
        """``ip``'s allowlist elements: membership, CIDR rules (from ``policy``; all of
        ``allow_net`` is read when it is unknown) and resolved addresses."""
        t = self.names.nft_table
        cmds: list[str] = []
        for set_name in ("allow_dst", "allow_net") if policy is None else ("allow_dst",):
            cmds += [
                f"delete element inet {t} {set_name} {{ {elem} }}"
                for elem in self._elements(set_name)
                if elem.split(" . ")[0] == ip
            ]
        if policy is not None:
            cmds += [
                f"delete element inet {t} allow_net {{ {ip} . {c.network} . {c.port} }}"
                for c in policy.cidrs
            ]
        for cmd in cmds:
            with contextlib.suppress(_nft.NftError):  # gone already (a timeout)
                _nft.host_run(cmd + "\n")
        for set_name in ("sni_match", "allowlisted"):
            with contextlib.suppress(_nft.NftError):
                _nft.host_run(f"delete element inet {t} {set_name} {{ {ip} }}\n")

    def _elements(self, set_name: str) -> list[str]:
        """The elements of a concatenated host set, as ``a . b[ . port]`` text."""
        try:
            out = _nft.host_run(f"list set inet {self.names.nft_table} {set_name}", json=True)
        except _nft.NftError as exc:
            if "No such file" in str(exc):
                return []
            raise BackendError(f"nft list set: {exc}") from exc
        found: list[str] = []
        for obj in json.loads(out).get("nftables", []):
            for elem in obj.get("set", {}).get("elem", []):
                val = elem.get("elem", {}).get("val", elem) if isinstance(elem, dict) else elem
                if isinstance(val, dict) and "concat" in val:
                    parts = []
                    for p in val["concat"]:
                        if isinstance(p, dict) and "prefix" in p:
                            parts.append(f"{p['prefix']['addr']}/{p['prefix']['len']}")
                        else:
                            parts.append(str(p))
                    found.append(" . ".join(parts))
        return found

    def _add_veth(self, sandbox_id: str, ip: str) -> None:
        hv = self.names.host_veth(sandbox_id)
        ns_fd = os.open(NETNS_DIR / self.names.netns(sandbox_id), os.O_RDONLY)
        try:
            # The far end is created inside the netns, already named eth0 and with
            # its MAC: nothing to rename. (Its ifindex is left to the kernel: a new
            # netns may hold fallback tunnel devices, sit0 & co., besides lo.)
            mac = _mac_for(ip)
            peer = (
                ifinfo()
                + attr_str(IFLA_IFNAME, "eth0")
                + attr(IFLA_ADDRESS, mac_bytes(mac))
                + attr_u32(IFLA_NET_NS_FD, ns_fd)
            )
            with Rtnl() as rt:
                bridge = self._ensure_bridge(rt, self.bridge_index(ip))
                rt.add_veth(hv, peer)
                _disable_ipv6(hv)  # before it is up: no link-local address, DAD or MLD
                rt.set_link(
                    hv,
                    attr_str(IFLA_IFALIAS, self.names.veth_alias(sandbox_id)),
                    attr_u32(IFLA_MASTER, bridge),
                )
                # The sandbox's MAC is known: a static forwarding entry on its port
                # spares the bridge learning it, and the first frame to a new
                # sandbox a flood to every port of the instance.
                rt.set_fdb_static(link_index(hv), mac)
                # A permanent neighbour entry on the bridge: the host never ARPs for
                # a sandbox, and the entry is exempt from neighbour GC. Dynamic
                # entries (one per live sandbox, plus one per sandbox for its
                # gateway) overflowed gc_thresh3 (1024 by default) past ~1000 live
                # sandboxes: connects to agents failed with EHOSTUNREACH.
                rt.set_neigh(bridge, ip, mac)
                # the port is isolated before it is up (the kernel applies slave
                # options before link flags within one request)
                rt.set_link(hv, bridge_port_isolated(), up=True)
        finally:
            os.close(ns_fd)

    def _sandbox_ruleset(self, network_access: bool) -> str:
        gw, port = self.gateway, self.config.agent_port
        if network_access:
            # replies to the sandbox's own connections: stateful, so conntrack
            return f"""
table inet hedgerow {{
  chain input {{
    type filter hook input priority 0; policy drop;
    iif "lo" accept
    ct state established,related accept
    ip saddr {gw} tcp dport {port} accept
  }}
  chain output {{
    type filter hook output priority 0; policy accept;
    oif "lo" accept
    ct state established,related accept
  }}
}}
"""
        # Without network access the only connections on eth0 are the control plane's
        # to the agent, so the rules need no state: no ct expression, hence no
        # conntrack in this netns at all. A netns holding conntrack entries when it
        # dies costs a walk of the machine's whole conntrack hash (262144 buckets)
        # in a kworker, and every packet a lookup. Nothing more leaves than before:
        # the agent's port is taken by its listener (no other socket can send from
        # it), and the host's input chain drops whatever is not an established
        # connection of the host's.
        return f"""
table inet hedgerow {{
  chain input {{
    type filter hook input priority 0; policy drop;
    iif "lo" accept
    ip saddr {gw} tcp dport {port} accept
  }}
  chain output {{
    type filter hook output priority 0; policy drop;
    oif "lo" accept
    ip daddr {gw} tcp sport {port} accept
  }}
}}
"""

    def netns_pids(self, sandbox_id: str) -> list[int]:
        return _netlink.netns_pids(self.names.netns(sandbox_id))

    def delete(
        self,
        sandbox_id: str,
        ip: str | None,
        *,
        policy: EgressPolicy | None = None,
    ) -> None:
        """Neighbour entry, veth, netns and egress element of ``sandbox_id``.

        ``ip``: the address its meta.json records; without it (a provision that
        died before writing it) every address the sandbox still claims.
        ``egress=False``: the sandbox had no network access, so it has no egress
        element to delete (a netfilter transaction saved per destroy).
        """
        ips = [ip] if ip else [a for a, owner in self.claims() if owner == sandbox_id]
        hv = self.names.host_veth(sandbox_id)
        try:
            with Rtnl() as rt:
                for address in ips:
                    for name in self._bridges_holding(address):
                        bridge = link_index(name)
                        if bridge:
                            rt.del_neigh(bridge, address)
                # Deleting the netns would take the pair with it, but only once its
                # last user is gone and then asynchronously: deleted here, it is gone
                # on return.
                rt.del_link(hv)
        except OSError as exc:
            raise BackendError(f"cannot delete neighbour entry or veth {hv}: {exc}") from exc
        self.delete_netns(self.names.netns(sandbox_id))
        for address in ips:
            if policy is None or policy.mode == "all":
                self.delete_egress(address)
            if policy is None or policy.mode == "allow":
                self.delete_allowlist(address, policy)

    def delete_neighbour(self, ip: str) -> None:
        try:
            with Rtnl() as rt:
                for name in self._bridges_holding(ip):
                    bridge = link_index(name)
                    if bridge:  # else gone with the bridge
                        rt.del_neigh(bridge, ip)
        except OSError as exc:
            raise BackendError(f"cannot delete neighbour entry {ip}: {exc}") from exc

    def delete_veth(self, name: str) -> None:
        try:
            with Rtnl() as rt:
                rt.del_link(name)
        except OSError as exc:
            raise BackendError(f"cannot delete veth {name}: {exc}") from exc

    def delete_netns(self, name: str) -> None:
        try:
            _netlink.delete_netns(name)
        except OSError as exc:
            raise BackendError(f"cannot delete netns {name}: {exc}") from exc

    def delete_egress(self, ip: str) -> None:
        # absent for sandboxes without network access (and a missing table: nothing
        # to delete); anything else is an error
        try:
            with _nft.NfNetlink() as nfnl:
                nfnl.set_element("inet", self.names.nft_table, "egress", ip, add=False)
        except OSError as exc:
            raise BackendError(f"cannot remove egress element {ip}: {exc}") from exc

    # ---- listings (raise on failure: callers must never act on a partial view) -------

    def list_netns(self) -> list[str]:
        try:
            entries = os.listdir(NETNS_DIR)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise BackendError(f"cannot list {NETNS_DIR}: {exc}") from exc
        return sorted(e for e in entries if e.startswith(self.names.netns_prefix))

    def list_veths(self) -> list[tuple[str, str | None]]:
        """(host veth name, sandbox id from its alias)."""
        out = run(["ip", "-j", "-d", "link", "show", "type", "veth"]).stdout
        found: list[tuple[str, str | None]] = []
        unaliased: list[str] = []
        for link in json.loads(out or "[]"):
            name, alias = link.get("ifname", ""), link.get("ifalias", "")
            sid = self.names.sandbox_from_alias(alias)
            if sid is not None:
                found.append((name, sid))
            elif name.startswith(self.names.veth_prefix) and not alias:
                unaliased.append(name)
        if unaliased:
            # The kernel takes no alias when it creates a link, so a veth being set up
            # has none for a moment. Its name is derived from its sandbox's id, and its
            # far end already sits in that sandbox's named netns: match it against our
            # netns, or a reconciler round (the warm pool's refill provisions while one
            # runs) reclaims a starting sandbox's veth as unparseable. Without such a
            # netns it is an orphan (sandbox id None).
            by_veth = {}
            for ns in self.list_netns():
                sid = self.names.sandbox_from_netns(ns)
                if sid is not None:
                    by_veth[self.names.host_veth(sid)] = sid
            found.extend((name, by_veth.get(name)) for name in unaliased)
        return found

    def list_neighbours(self) -> list[str]:
        """Addresses with a permanent neighbour entry on one of this instance's bridges."""
        found: list[str] = []
        for bridge in self.bridges():
            out = run(["ip", "-j", "-4", "neigh", "show", "dev", bridge, "nud", "permanent"])
            found += [n["dst"] for n in json.loads(out.stdout or "[]") if n.get("dst")]
        return found

    def list_allowlisted(self) -> list[str]:
        """Addresses holding allowlist elements: members of ``allowlisted`` and the
        sources of ``allow_net``/``allow_dst`` elements (one left without the other)."""
        found: set[str] = set()
        try:
            out = _nft.host_run(f"list set inet {self.names.nft_table} allowlisted", json=True)
        except _nft.NftError as exc:
            if "No such file" in str(exc):
                return []
            raise BackendError(f"nft list set: {exc}") from exc
        for obj in json.loads(out).get("nftables", []):
            found.update(e for e in obj.get("set", {}).get("elem", []) if isinstance(e, str))
        for set_name in ("allow_net", "allow_dst"):
            found.update(elem.split(" . ")[0] for elem in self._elements(set_name))
        return sorted(found)

    def list_egress(self) -> list[str]:
        try:
            out = _nft.host_run(f"list set inet {self.names.nft_table} egress", json=True)
        except _nft.NftError as exc:
            if "No such file" in str(exc):
                return []
            raise BackendError(f"nft list set: {exc}") from exc
        ips: list[str] = []
        for obj in json.loads(out).get("nftables", []):
            elems = obj.get("set", {}).get("elem", [])
            ips.extend(e for e in elems if isinstance(e, str))
        return ips


def _enable_forwarding() -> None:
    path = Path("/proc/sys/net/ipv4/ip_forward")
    try:
        if path.read_text().strip() != "1":
            path.write_text("1\n")
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise BackendError(f"cannot enable forwarding: {exc}") from exc


_ipv6_warned = False


def _disable_ipv6(device: str) -> None:
    """IPv6 off for ``device`` (or ``default``: devices made later) in the calling
    thread's netns. Sandboxes have IPv4 only by design (every host rule is IPv4);
    IPv6 on their links only cost address configuration, DAD and MLD timers and
    route teardown (fib6) when the link goes. Best effort: where /proc/sys is
    read-only (some containers) IPv6 stays on, which costs CPU, not isolation."""
    global _ipv6_warned
    try:
        with open(f"/proc/sys/net/ipv6/conf/{device}/disable_ipv6", "w") as fh:
            fh.write("1\n")
    except FileNotFoundError:
        return  # a kernel without IPv6
    except OSError as exc:
        if not _ipv6_warned:
            _ipv6_warned = True
            log.warning("cannot disable IPv6 on sandbox links (%s): left on", exc)


def _link_mac(name: str) -> str:
    try:
        return Path(f"/sys/class/net/{name}/address").read_text().strip()
    except OSError:
        return ""


def _mac_for(ip: str) -> str:
    """A locally administered MAC derived from the sandbox's IP.

    Addresses are reused as sandboxes come and go. With random MACs the host's
    neighbour entry for a reused IP still names the old sandbox's MAC, and connects
    hang for seconds while the kernel probes it (seen as agents "not healthy after
    30 s" in a 1000-sandbox run). The same IP always gets the same MAC, so a stale
    entry stays right.
    """
    octets = [int(part) for part in ip.split(".")]
    return "02:68:" + ":".join(f"{octet:02x}" for octet in octets)
