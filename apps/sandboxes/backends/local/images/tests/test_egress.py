"""The registry egress policy (egress.py): what the control plane's skopeo may be
pointed at. Unit checks of the address rule with an injected resolver, then the store
against the real loopback registry: a refused registry never sees a request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from apps.sandboxes.backends.local.images import (
    ImageStore,
    RegistryForbidden,
    RegistryPolicy,
    RegistryUnreachable,
    parse,
)
from apps.sandboxes.backends.local.images.egress import public_address
from apps.sandboxes.backends.local.images.errors import PUBLIC_MESSAGES
from apps.sandboxes.backends.local.images.skopeo import Credentials, Skopeo
from apps.sandboxes.backends.local.images.tests.ocibuild import Layout, busybox_layer
from apps.sandboxes.backends.local.images.tests.registry import Registry

PUBLIC = "93.184.216.34"  # a public address: never contacted (the resolver is a stub)


def _resolver(table: dict[str, list[str]]) -> Any:
    def resolve(host: str) -> list[str]:
        if host not in table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return table[host]

    return resolve


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.9.9.9",
        "::1",
        "169.254.169.254",  # cloud metadata
        "fe80::1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",  # CGNAT
        "fd00::1",  # unique local
        "224.0.0.1",
        "ff02::1",
        "0.0.0.0",
        "::",
        "192.0.2.1",  # documentation
        "240.0.0.1",  # reserved
        "::ffff:127.0.0.1",  # IPv4-mapped loopback
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    ],
)
def test_non_public_addresses_are_refused(address):
    assert not public_address(address)


@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_allowed(address):
    assert public_address(address)


@pytest.mark.parametrize(
    "reference",
    [
        "127.0.0.1:5000/a/b:1",
        "localhost:5000/a/b:1",
        "169.254.169.254/latest/meta-data:1",
        "10.0.0.7:5000/a/b:1",
        "[::1]:5000/a/b:1",
        "[fd12::7]:5000/a/b:1",
        "internal.corp:5000/a/b:1",  # resolves to a private address
        "rebind.example.com/a/b:1",  # one public and one loopback answer
    ],
)
def test_the_default_policy_refuses_non_public_registries(reference):
    policy = RegistryPolicy.of(
        resolver=_resolver(
            {
                "localhost": ["127.0.0.1", "::1"],
                "internal.corp": ["10.9.8.7"],
                "rebind.example.com": [PUBLIC, "127.0.0.1"],
            }
        )
    )
    with pytest.raises(RegistryForbidden) as e:
        policy.check(parse(reference))
    assert e.value.code == "registry_forbidden"
    assert e.value.message == PUBLIC_MESSAGES["registry_forbidden"]
    # the addresses are for the operator's log, never in the tenant's message
    assert "127.0.0.1" not in e.value.message and "10.9.8.7" not in e.value.message


def test_public_names_pass_and_every_check_resolves_again():
    answers = [[PUBLIC], ["127.0.0.1"]]
    asked: list[str] = []

    def rebinding(host: str) -> list[str]:
        asked.append(host)
        return answers[min(len(asked), len(answers)) - 1]

    policy = RegistryPolicy.of(resolver=rebinding)
    ref = parse("registry.example.com/a/b:1")
    policy.check(ref)  # public: allowed
    with pytest.raises(RegistryForbidden):
        policy.check(ref)  # the same name now points at loopback: refused
    assert asked == ["registry.example.com", "registry.example.com"]


def test_a_name_that_does_not_resolve_is_unreachable_without_the_resolver_text():
    policy = RegistryPolicy.of(resolver=_resolver({}))
    with pytest.raises(RegistryUnreachable) as e:
        policy.check(parse("nowhere.invalid/a:1"))
    assert e.value.message == PUBLIC_MESSAGES["registry_unreachable"]
    assert "Name or service not known" in e.value.detail


def test_allow_and_insecure_lists_deny_list_and_the_private_escape_hatch():
    resolve = _resolver({"registry.internal": ["10.0.0.5"], "evil.example.com": [PUBLIC]})
    internal = parse("registry.internal/a:1")
    on_port = parse("127.0.0.1:5000/a:1")
    other_port = parse("127.0.0.1:5001/a:1")
    policy = RegistryPolicy.of(
        allow=["registry.internal"],
        insecure=["127.0.0.1:5000"],
        deny=["evil.example.com"],
        resolver=resolve,
    )
    policy.check(internal)  # host entry: any port
    policy.check(parse("registry.internal:8443/a:1"))
    policy.check(on_port)  # host:port entry: that port only
    with pytest.raises(RegistryForbidden):
        policy.check(other_port)
    with pytest.raises(RegistryForbidden):
        policy.check(parse("evil.example.com/a:1"))  # public, but denied
    # plain HTTP only for the insecure list (allowed is not insecure)
    assert policy.plain_http(on_port) and not policy.plain_http(internal)
    # the escape hatch turns the address check off, not the deny list
    open_policy = RegistryPolicy.of(allow_private=True, deny=["evil.example.com"], resolver=resolve)
    open_policy.check(other_port)
    open_policy.check(parse("169.254.169.254/a:1"))
    with pytest.raises(RegistryForbidden):
        open_policy.check(parse("evil.example.com/a:1"))


# --- the store: checked before every skopeo call ------------------------------------


def _push(registry: Registry, tmp: Path, repo: str) -> str:
    lay = Layout(tmp / f"layout-{repo.replace('/', '-')}")
    lay.tag("v1", lay.image([busybox_layer()], {"Cmd": ["/bin/sh"]}))
    ref = f"{registry.host}/{repo}:v1"
    lay.push("v1", ref, registry.creds)
    return ref


def test_an_unlisted_loopback_registry_is_refused_before_any_request(
    open_registry: Registry, tmp_path: Path
):
    ref = _push(open_registry, tmp_path, "egress/loop")
    store = ImageStore(tmp_path / "store")  # the default policy: nothing listed
    for call in (store.resolve, store.pull):
        with pytest.raises(RegistryForbidden):
            call(ref)
    assert open_registry.manifest_gets("egress/loop") == 0
    assert open_registry.blob_gets("egress/loop") == 0
    assert store.records() == []
    # the same registry, listed by the operator, works (plain HTTP because listed)
    listed = ImageStore(tmp_path / "store", policy=RegistryPolicy.of(insecure=[open_registry.host]))
    assert listed.pull(ref).reference == ref
    assert open_registry.manifest_gets("egress/loop") >= 1


def test_allowed_but_not_insecure_gets_tls_and_no_plain_http(
    open_registry: Registry, tmp_path: Path
):
    ref = _push(open_registry, tmp_path, "egress/tls")
    store = ImageStore(
        tmp_path / "store",
        policy=RegistryPolicy.of(allow=[open_registry.host]),
        skopeo=Skopeo(retry_times=0),
    )
    with pytest.raises(RegistryUnreachable) as e:  # HTTPS to a plain-HTTP registry
        store.resolve(ref)
    assert e.value.message == PUBLIC_MESSAGES["registry_unreachable"]
    assert "HTTP response to HTTPS client" in e.value.detail  # skopeo's, for the log
    assert open_registry.manifest_gets("egress/tls") == 0


class _FakeSkopeo(Skopeo):
    """Serves one manifest without a registry; records every call."""

    def __init__(self, manifest: bytes) -> None:
        super().__init__()
        self.raw = manifest
        self.calls: list[str] = []

    def manifest(self, ref: Any, what: str, auth: Path, insecure: bool) -> bytes:
        self.calls.append("manifest")
        return self.raw

    def copy(self, ref: Any, digest: str, layout: Path, auth: Path, insecure: bool) -> None:
        self.calls.append("copy")
        raise AssertionError("copy must not run against a rebound registry")


def test_a_name_rebinding_between_the_manifest_and_the_fetch_is_refused_at_the_fetch(
    tmp_path: Path,
):
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": "sha256:" + "a" * 64,
            "size": 2,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": "sha256:" + "b" * 64,
                "size": 2,
            }
        ],
    }
    answers = iter([[PUBLIC], ["169.254.169.254"]])
    fake = _FakeSkopeo(json.dumps(manifest).encode())
    store = ImageStore(
        tmp_path / "store",
        policy=RegistryPolicy.of(resolver=lambda _host: next(answers)),
        skopeo=fake,
    )
    with pytest.raises(RegistryForbidden):
        store.pull("registry.example.com/a/b:1", credentials=Credentials("u", "p"))
    assert fake.calls == ["manifest"]  # the fetch never started
