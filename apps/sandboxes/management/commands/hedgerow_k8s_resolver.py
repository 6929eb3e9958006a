from __future__ import annotations

import logging
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.core.redis_sync import redis_client


class Command(BaseCommand):
    help = (
        "Runs the in-cluster DNS resolver of egress allowlists on Kubernetes "
        '(docs/egress.md "Kubernetes"; deploy/base/resolver.yaml).'
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--listen", default="0.0.0.0")
        parser.add_argument("--port", type=int, default=5353)
        parser.add_argument(
            "--upstream", default="", help="ip[:port]; default: the pod's own nameserver"
        )
        parser.add_argument("--grace", type=int, default=30, help="seconds beyond a TTL")
        parser.add_argument(
            "--cache", type=float, default=2.0, help="seconds a pod's policy is kept"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        from apps.sandboxes.backends.kubernetes import (
            api_client_from_settings,
            check_permissions,
            config_from_settings,
        )
        from apps.sandboxes.backends.kubernetes.api import KubeApi
        from apps.sandboxes.backends.kubernetes.backend import KubernetesBackend
        from apps.sandboxes.backends.kubernetes.egress_allow import AllowlistEgress
        from apps.sandboxes.backends.kubernetes.resolver import (
            ClusterResolver,
            PodDirectory,
            run,
        )
        from apps.sandboxes.backends.local import resolver as local

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        config = config_from_settings()
        api = KubeApi(api_client_from_settings(config.max_concurrency), config)
        check_permissions(api)
        upstream = opts["upstream"] or local.system_upstream()
        if not upstream:
            raise CommandError("no upstream nameserver: give --upstream")
        policies = KubernetesBackend(config, api).policies
        resolver = ClusterResolver(
            PodDirectory(api, policies, config, cache_s=opts["cache"]),
            local.parse_upstream(upstream),
            AllowlistEgress(api, policies, config),
            redis_client(),
            grace_s=opts["grace"],
        )
        run(resolver, opts["listen"], opts["port"])
