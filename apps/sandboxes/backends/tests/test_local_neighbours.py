"""Permanent neighbour entries: the host never ARPs for a sandbox, nor a sandbox for
its gateway, and no live sandbox depends on the neighbour table's GC thresholds."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local._netlink import Rtnl, delete_netns, in_new_netns, link_index

from .conftest import Sandbox, needs_root, new_spec

pytestmark = needs_root


def _json(*argv: str) -> list[dict[str, object]]:
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return list(json.loads(out or "[]"))


def _bridge_neighbours(backend: LocalBackend) -> dict[str, dict[str, object]]:
    rows = _json("ip", "-j", "-4", "neigh", "show", "dev", backend.names.bridge)
    return {str(r["dst"]): r for r in rows}


def _mac(ip: str) -> str:
    return "02:68:" + ":".join(f"{int(o):02x}" for o in ip.split("."))


def test_it_pins_both_ends_neighbours_and_removes_the_hosts_with_the_sandbox(
    backend: LocalBackend,
) -> None:
    spec = new_spec()
    endpoint = backend.provision(spec)
    sid, ip = spec.sandbox_id, endpoint.host
    try:
        assert wait_healthy(endpoint, spec.agent_token)["status"] == "ok"
        assert Sandbox(backend, spec, endpoint).sh("echo hi") == (0, "hi\n", "")
        entry = _bridge_neighbours(backend)[ip]
        assert entry["lladdr"] == _mac(ip) and entry["state"] == ["PERMANENT"]
        gw = backend.network.gateway
        inside = _json("ip", "-n", backend.names.netns(sid), "-j", "-4", "neigh", "show")
        assert [(r["dst"], r["dev"], r["lladdr"], r["state"]) for r in inside] == [
            (gw, "eth0", _mac(gw), ["PERMANENT"])
        ]
        link = _json("ip", "-j", "link", "show", "dev", backend.names.bridge)[0]
        assert link["address"] == _mac(gw)  # what the sandbox's entry names
        fdb = _json("bridge", "-j", "fdb", "show", "dev", backend.names.host_veth(sid))
        assert any(f["mac"] == _mac(ip) and f.get("state") == "static" for f in fdb)
        items = [i for i in backend.inventory() if i.kind == "neighbour"]
        assert [(i.name, i.sandbox_id) for i in items if i.name == f"neigh:{ip}"] == [
            (f"neigh:{ip}", sid)
        ]
    finally:
        backend.destroy(sid)
    assert ip not in _bridge_neighbours(backend)
    assert all(i.name != f"neigh:{ip}" for i in backend.inventory())


def test_it_removes_the_entry_of_a_sandbox_whose_meta_is_lost(backend: LocalBackend) -> None:
    spec = new_spec()
    ip = backend.provision(spec).host
    (backend.sandboxes_dir / spec.sandbox_id / "meta.json").unlink()
    backend.destroy(spec.sandbox_id)  # from the names and the address claim alone
    assert ip not in _bridge_neighbours(backend)


def test_it_lists_a_leftover_entry_as_unowned_and_reclaims_it(backend: LocalBackend) -> None:
    backend.network.ensure_instance()
    claimed = {ip for ip, _ in backend.network.claims()}
    ip = next(str(a) for a in list(backend.network.subnet.hosts())[-20:] if str(a) not in claimed)
    with Rtnl() as rt:
        rt.set_neigh(link_index(backend.names.bridge), ip, _mac(ip))
    assert ip in _bridge_neighbours(backend)
    [item] = [i for i in backend.inventory() if i.name == f"neigh:{ip}"]
    assert item.kind == "neighbour" and item.sandbox_id is None
    backend.reclaim(item)
    assert ip not in _bridge_neighbours(backend)
    assert all(i.kind != "neighbour" or i.sandbox_id for i in backend.inventory())


def test_it_relies_on_permanent_entries_being_exempt_from_gc_thresh3() -> None:
    """The kernel premise of the fix, on this kernel: more permanent entries than
    gc_thresh3 allows dynamic ones all go in. The thresholds are the machine's
    (the ARP table is one for every netns; a netns has no neigh/default sysctls to
    lower), so the entries go on a veth in a netns of the test's own."""
    thresh3 = int(Path("/proc/sys/net/ipv4/neigh/default/gc_thresh3").read_text())
    name = f"hedgerow-neightest-{uuid.uuid4().hex[:8]}"
    count = thresh3 + 64

    try:
        ns_rt, _ = in_new_netns(name, lambda rt: None)
        with ns_rt:
            subprocess.run(
                ["ip", "-n", name, "link", "add", "n0", "type", "veth", "peer", "name", "n1"],
                check=True,
            )
            index = ns_rt.index_of("n0")
            for k in range(count):
                ns_rt.set_neigh(index, f"10.77.{k >> 8}.{k & 255}", "02:00:00:00:00:01")
        rows = _json("ip", "-n", name, "-j", "-4", "neigh", "show", "nud", "permanent")
        assert len(rows) == count > thresh3
    finally:
        delete_netns(name)
