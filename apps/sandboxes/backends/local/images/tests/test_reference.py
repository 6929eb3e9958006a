"""Reference parsing and the plain-HTTP rule (no registry needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.sandboxes.backends.local.images import (
    ImageStore,
    ImageStoreError,
    InvalidReference,
    RegistryPolicy,
    parse,
)

DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    "text,expected",
    [
        ("python:3.12-slim", "docker.io/library/python:3.12-slim"),
        ("ubuntu", "docker.io/library/ubuntu:latest"),
        ("org/img", "docker.io/org/img:latest"),
        ("docker.io/library/python:3.12-slim", "docker.io/library/python:3.12-slim"),
        (f"ghcr.io/org/img@{DIGEST}", f"ghcr.io/org/img@{DIGEST}"),
        (f"ghcr.io/org/img:v1@{DIGEST}", f"ghcr.io/org/img:v1@{DIGEST}"),
        ("127.0.0.1:5000/swe/astropy-12907:latest", "127.0.0.1:5000/swe/astropy-12907:latest"),
        ("localhost/x", "localhost/x:latest"),
        ("[::1]:5000/a/b:c", "[::1]:5000/a/b:c"),
    ],
)
def test_references_normalised(text, expected):
    assert str(parse(text)) == expected


@pytest.mark.parametrize(
    "text",
    ["", " python", "Python:3", "python:", "a/../b", "img@sha256:abc", "a//b", "a:b:c", "x" * 600],
)
def test_bad_references_refused(text):
    with pytest.raises(InvalidReference) as e:
        parse(text)
    assert e.value.code == "image_reference_invalid"


def test_plain_http_only_for_registries_listed_insecure_not_even_loopback(tmp_path: Path):
    store = ImageStore(
        tmp_path, policy=RegistryPolicy.of(insecure=["registry.lan:5000", "lan2.internal"])
    )
    insecure = ["registry.lan:5000/a", "lan2.internal:5000/a", "lan2.internal/a"]
    secure = [
        "registry.lan/a",
        "registry.lan:5001/a",
        "docker.io/library/a",
        "ghcr.io/o/a",
        "127.0.0.1:5000/a",
        "localhost:5000/a",
        "[::1]:5000/a",
    ]
    assert [store.is_insecure(parse(r)) for r in insecure] == [True] * len(insecure)
    assert [store.is_insecure(parse(r)) for r in secure] == [False] * len(secure)


GOOD = {"digest": DIGEST, "size": 1}


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"config": GOOD},
        {"config": GOOD, "layers": []},
        {"config": GOOD, "layers": "x"},
        {"config": {"digest": DIGEST}, "layers": [GOOD]},
        {"config": GOOD, "layers": [{"digest": DIGEST, "size": "1"}]},
        {"config": GOOD, "layers": [{"digest": "sha256:../../etc/passwd", "size": 1}]},
        {"config": {"digest": "sha512:" + "a" * 128, "size": 1}, "layers": [GOOD]},
    ],
)
def test_malformed_manifests_are_typed_errors(doc):
    # a registry's or archive's JSON decides file names under the store: checked first
    with pytest.raises(ImageStoreError) as e:
        ImageStore._check_manifest("img", doc)
    assert e.value.code == "image_store_error"
