"""The client-side request rate (api.py ``RateLimiter``): a token bucket per process,
and a 429's ``Retry-After`` held by every call, not only the one that got it. A clock
that moves only when the limiter sleeps makes the waits exact (no real time passes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.test import override_settings
from kubernetes import client

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.kubernetes import KubeApi, config_from_settings
from apps.sandboxes.backends.kubernetes.api import RateLimiter

from .conftest import NS, make_config
from .fakekube import FakeKube


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


def test_the_bucket_lets_a_burst_through_then_paces_at_the_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(qps=10, burst=3, clock=clock, sleep=clock.sleep)
    waits = [round(limiter.acquire(), 6) for _ in range(6)]
    assert waits == [0, 0, 0, 0.1, 0.1, 0.1]  # 3 at once, then one per 1/qps
    clock.now += 1.0  # idle for a second: the bucket refills, up to the burst only
    assert [round(limiter.acquire(), 6) for _ in range(4)] == [0, 0, 0, 0.1]


def test_a_hold_stops_every_caller_until_it_has_passed() -> None:
    clock = Clock()
    limiter = RateLimiter(qps=100, burst=10, clock=clock, sleep=clock.sleep)
    limiter.hold(7.0)
    assert limiter.acquire() == pytest.approx(7.0)  # the first caller waits it out
    assert limiter.acquire() == 0  # and the hold is over for the next
    limiter.hold(2.0)
    limiter.hold(1.0)  # a shorter hold never shortens a longer one
    assert limiter.acquire() == pytest.approx(2.0)


def test_no_rate_means_no_pacing_but_holds_still_apply() -> None:
    clock = Clock()
    limiter = RateLimiter(qps=0, burst=1, clock=clock, sleep=clock.sleep)
    assert [limiter.acquire() for _ in range(100)] == [0] * 100
    limiter.hold(3.0)
    assert limiter.acquire() == pytest.approx(3.0)


def _api(fake: FakeKube, clock: Clock, **overrides: object) -> KubeApi:
    configuration = client.Configuration()
    configuration.host = fake.url
    configuration.retries = False
    config = make_config(**overrides)
    api = KubeApi(client.ApiClient(configuration), config, backoff_s=0.01)
    api.limiter = RateLimiter(config.api_qps, config.api_burst, clock=clock, sleep=clock.sleep)
    return api


def _create(api: KubeApi, name: str) -> Callable[[], object]:
    body = {"metadata": {"name": name}, "type": "Opaque", "data": {}}
    return lambda: api.call(api.core.create_namespaced_secret, NS, body)


def test_a_429_retry_after_is_waited_out_once_then_the_call_goes_through(
    fake: FakeKube,
) -> None:
    clock = Clock()
    api = _api(fake, clock, api_qps=0)
    fake.retry_after = "7"
    fake.fail_next(429)
    sent = len(fake.requests)

    _create(api, "s1")()

    assert clock.slept == [7.0]  # what the server asked, before the one retry
    assert len(fake.requests) - sent == 2 and api.retries_done == 1
    assert ("secrets", NS, "s1") in fake.objects
    _create(api, "s2")()  # the hold has passed: the next call does not wait
    assert clock.slept == [7.0]


def test_creates_are_paced_by_the_rate_and_429s_exhaust_into_a_transient_error(
    fake: FakeKube,
) -> None:
    clock = Clock()
    api = _api(fake, clock, api_qps=5, api_burst=2, api_retries=3)
    for i in range(5):
        _create(api, f"p{i}")()
    assert clock.slept == [0.2, 0.2, 0.2]  # 2 at once, then 5 per second
    fake.retry_after = "1"
    fake.fail_next(429, 429, 429)
    with pytest.raises(BackendError) as caught:
        _create(api, "never")()
    assert caught.value.transient
    assert ("secrets", NS, "never") not in fake.objects


def test_the_settings_reach_the_config_and_bad_values_are_refused() -> None:
    with override_settings(HEDGEROW_K8S_API_QPS=12.5, HEDGEROW_K8S_API_BURST=7):
        config = config_from_settings()
    assert (config.api_qps, config.api_burst) == (12.5, 7)
    with pytest.raises(BackendError, match="api_qps"):
        make_config(api_qps=-1)
    with pytest.raises(BackendError, match="api_burst"):
        make_config(api_burst=0)
