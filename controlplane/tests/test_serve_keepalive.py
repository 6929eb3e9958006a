"""The web server keeps an idle keep-alive connection longer than HTTP clients keep
pooled ones (controlplane/serve.py): uvicorn's own default is 5 s, reqwest's and Go's
pool idle is 90 s, so a client reused a connection the server was closing at that
moment ("connection closed before message completed", a flaky E2B resume test). The
configuration is asserted, not waited for: no test sleeps 90 s."""

from __future__ import annotations

from typing import Any

import pytest
import uvicorn

from controlplane import serve

COMMON_CLIENT_POOL_IDLE_S = 90  # reqwest, Go net/http; httpx and aiohttp keep less


def _configured(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> uvicorn.Config:
    seen: dict[str, Any] = {}

    def capture(app: Any, **kwargs: Any) -> None:
        seen.update(kwargs, app=app)

    monkeypatch.setattr(uvicorn, "run", capture)
    with pytest.raises(SystemExit) as exited:  # click's standalone mode exits
        serve.main(argv)
    assert exited.value.code in (0, None)
    app = seen.pop("app")
    seen.pop("app_dir", None)  # uvicorn.run puts it on sys.path; not a Config field
    return uvicorn.Config(app, **seen)


def test_the_default_outlasts_common_client_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _configured(monkeypatch, ["controlplane.asgi:application", "--http", "httptools"])
    assert config.timeout_keep_alive == serve.KEEP_ALIVE_S == 120
    assert config.timeout_keep_alive > COMMON_CLIENT_POOL_IDLE_S
    assert config.http is serve.BoundedHttpToolsProtocol  # still the bounded head


@pytest.mark.parametrize("spelling", [["--timeout-keep-alive", "7"], ["--timeout-keep-alive=7"]])
def test_an_explicit_keep_alive_is_kept(
    monkeypatch: pytest.MonkeyPatch, spelling: list[str]
) -> None:
    config = _configured(monkeypatch, ["controlplane.asgi:application", *spelling])
    assert config.timeout_keep_alive == 7


def test_the_running_test_server_says_it_uses_the_long_keep_alive(live: Any) -> None:
    # The stack's web process was started as the tests start it (conftest.Stack, no
    # keep-alive on its command line); it logs what uvicorn was given at start.
    assert "--timeout-keep-alive" not in live.web.args
    assert "idle keep-alive connections close after 120 s" in live.web.log_path.read_text()
