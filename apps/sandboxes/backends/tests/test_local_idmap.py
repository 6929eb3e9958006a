"""Which host ids a sandbox maps to (idmap.py): derived from its address, and the
instance-wide claims that keep two subnets from sharing a range."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.local import idmap
from podagent.userns import RANGE, id_map


def test_the_base_is_the_low_16_bits_of_the_address_times_65536() -> None:
    assert idmap.uid_base("10.213.0.2") == 2 * RANGE
    assert idmap.uid_base("10.213.7.9") == (7 * 256 + 9) * RANGE
    assert idmap.uid_base("10.214.7.9") == idmap.uid_base("10.213.7.9")  # hence the claims
    assert idmap.uid_base("10.213.255.254") == (1 << 32) - 2 * RANGE  # the highest
    for never_a_sandbox in ("10.213.0.0", "10.213.255.255"):
        with pytest.raises(ValueError, match="not a multiple"):
            idmap.uid_base(never_a_sandbox)
    assert id_map(2 * RANGE) == b"0 131072 65536\n"
    with pytest.raises(ValueError):
        id_map(RANGE + 1)


def test_a_subnet_claims_its_blocks_and_another_subnet_is_refused(tmp_path: Path) -> None:
    claims = tmp_path / "subnets"
    claims.mkdir()
    mine = ipaddress.IPv4Network("10.213.7.0/24")
    idmap.claim_blocks(claims, mine, "a /state/a")
    idmap.claim_blocks(claims, mine, "a /state/a")  # again (a restart): fine
    assert (tmp_path / "uids" / "7").read_text() == "10.213.7.0/24 a /state/a\n"
    other = ipaddress.IPv4Network("10.214.7.0/24")
    assert not idmap.blocks_free(claims, other)
    assert idmap.blocks_free(claims, ipaddress.IPv4Network("10.214.8.0/24"))
    with pytest.raises(BackendError, match=r"held by '10\.213\.7\.0/24 a /state/a'"):
        idmap.claim_blocks(claims, other, "b /state/b")
    wide = ipaddress.IPv4Network("10.214.8.0/21")  # octets 8..15
    idmap.claim_blocks(claims, wide, "c /state/c")
    assert sorted(int(p.name) for p in (tmp_path / "uids").iterdir()) == [7, *range(8, 16)]
    with pytest.raises(BackendError, match="larger than a /16"):
        idmap.claim_blocks(claims, ipaddress.IPv4Network("10.0.0.0/15"), "d /state/d")
    idmap.release_blocks(claims, other)  # not its blocks: nothing released
    assert (tmp_path / "uids" / "7").exists()
    idmap.release_blocks(claims, mine)
    assert not (tmp_path / "uids" / "7").exists()


def test_gc_drops_blocks_whose_subnet_is_no_longer_claimed(tmp_path: Path) -> None:
    claims = tmp_path / "subnets"
    claims.mkdir()
    (claims / "10.213.3.0").write_text("live /state/live\n")
    idmap.claim_blocks(claims, ipaddress.IPv4Network("10.213.3.0/24"), "live /state/live")
    idmap.claim_blocks(claims, ipaddress.IPv4Network("10.213.4.0/24"), "dead /state/dead")
    idmap.release_orphans(claims)
    assert sorted(p.name for p in (tmp_path / "uids").iterdir()) == ["3"]
