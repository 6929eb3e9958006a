"""The web process's cyclic garbage collector, tuned for many requests in flight.

With 200 requests in flight, a worker holds ~200 requests' worth of live containers
(threads' frames, requests, querysets, futures): the net allocation count that
triggers a generation-0 collection is reached several times more often per request
than one request at a time, those objects survive into the older generations, and each
full collection walks the whole heap — Django, DRF, the URL conf, every model and
serializer class loaded at start-up. Measured in one process
(``bench.web_request_cost 400 --concurrency 200``, docs/benchmarks.md): 0.26–0.78 ms of
the collector's CPU per request at 200 in flight, against 0.01–0.19 ms one at a time;
0.07–0.48 ms with this tuning.

``gc.freeze()`` after start-up moves that start-up heap into the permanent generation,
which no collection walks; a larger generation-0 threshold makes young collections
rarer (request handling makes few reference cycles: the collector is a backstop here,
reference counting frees nearly everything). Objects are still collected, cycles
included; only how often and over what changes.
"""

from __future__ import annotations

import gc

from django.conf import settings


def web_gc_tune() -> None:
    """Freeze what start-up loaded and apply the configured thresholds (web only)."""
    gc.set_threshold(*settings.HEDGEROW_WEB_GC_THRESHOLD)
    if settings.HEDGEROW_WEB_GC_FREEZE:
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()
