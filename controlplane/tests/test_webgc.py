"""The web process's collector tuning (controlplane/webgc.py): the start-up heap is
frozen and the configured thresholds apply in the process uvicorn serves."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from apps.core.env import env_ints
from controlplane.webgc import web_gc_tune

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gc_state() -> Iterator[None]:
    """Each test starts unfrozen and leaves this process's collector as it found it."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_it_freezes_the_start_up_heap_and_sets_the_thresholds(gc_state: None) -> None:
    loaded_at_start_up = {"a": [1, 2, 3]}
    with override_settings(HEDGEROW_WEB_GC_FREEZE=True, HEDGEROW_WEB_GC_THRESHOLD=(12345, 7, 9)):
        web_gc_tune()
    assert gc.get_threshold() == (12345, 7, 9)
    assert gc.get_freeze_count() > 0
    # Frozen: no generation holds it any more, so no collection walks it.
    assert not any(o is loaded_at_start_up for o in gc.get_objects())


def test_it_leaves_the_heap_unfrozen_when_off(gc_state: None) -> None:
    with override_settings(HEDGEROW_WEB_GC_FREEZE=False, HEDGEROW_WEB_GC_THRESHOLD=(700, 10, 10)):
        web_gc_tune()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == (700, 10, 10)


def test_it_applies_the_settings_in_the_served_application() -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "HEDGEROW_SECRET_KEY": settings.SECRET_KEY,
        "HEDGEROW_WEB_GC_THRESHOLD": "4321,5,6",
    }
    env.pop("HEDGEROW_WEB_GC_FREEZE", None)
    code = "import gc, controlplane.asgi; print(gc.get_threshold(), gc.get_freeze_count() > 0)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(4321, 5, 6) True"


def test_it_reads_the_thresholds_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HR_TEST_INTS", " 10000, 10,10 ")
    assert env_ints("HR_TEST_INTS", (700, 10, 10)) == (10000, 10, 10)
    monkeypatch.setenv("HR_TEST_INTS", "")
    assert env_ints("HR_TEST_INTS", (700, 10, 10)) == (700, 10, 10)
    for bad in ("10000,10", "10000,10,10,1", "0,10,10", "1e4,10,10", "many"):
        monkeypatch.setenv("HR_TEST_INTS", bad)
        with pytest.raises(ImproperlyConfigured, match="HR_TEST_INTS"):
            env_ints("HR_TEST_INTS", (700, 10, 10))
