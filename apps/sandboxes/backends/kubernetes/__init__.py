"""The Kubernetes backend: one pod per sandbox, the agent injected from a bundle,
NetworkPolicies for isolation, readiness from a LIST+WATCH informer.

``build_kubernetes_backend()`` is what ``apps.sandboxes.backends.get_backend`` calls
when ``HEDGEROW_BACKEND=kubernetes``.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from kubernetes import client
from kubernetes import config as kube_config

from .api import KubeApi
from .backend import KubernetesBackend
from .config import (
    DEFAULT_CAPABILITIES,
    DEFAULT_EGRESS_EXCEPT_V4,
    DEFAULT_EGRESS_EXCEPT_V6,
    startup_refusals,
)
from .config import KubernetesConfig as KubernetesConfig
from .permissions import permission_refusal, process_role

__all__ = [
    "KubeApi",
    "KubernetesBackend",
    "KubernetesConfig",
    "build_kubernetes_backend",
    "check_permissions",
    "check_startup",
    "config_from_settings",
]


def _json_setting(name: str, expected: type) -> Any:
    raw = getattr(settings, name)
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be JSON: {exc}") from exc
    if not isinstance(value, expected):
        raise ImproperlyConfigured(f"{name} must be a JSON {expected.__name__}")
    return value


def config_from_settings() -> KubernetesConfig:
    return KubernetesConfig(
        instance=settings.HEDGEROW_INSTANCE,
        namespace=settings.HEDGEROW_K8S_NAMESPACE,
        controlplane_namespace=settings.HEDGEROW_K8S_CONTROLPLANE_NAMESPACE,
        injector_image=settings.HEDGEROW_K8S_INJECTOR_IMAGE,
        images=tuple(settings.HEDGEROW_K8S_IMAGES),
        default_image=settings.HEDGEROW_K8S_DEFAULT_IMAGE,
        runtime_class=settings.HEDGEROW_K8S_RUNTIME_CLASS,
        node_selector=_json_setting("HEDGEROW_K8S_NODE_SELECTOR", dict),
        tolerations=_json_setting("HEDGEROW_K8S_TOLERATIONS", list),
        image_pull_secrets=tuple(settings.HEDGEROW_K8S_IMAGE_PULL_SECRETS),
        capabilities=tuple(settings.HEDGEROW_K8S_CAPABILITIES) or DEFAULT_CAPABILITIES,
        egress_except=tuple(settings.HEDGEROW_K8S_EGRESS_EXCEPT)
        or DEFAULT_EGRESS_EXCEPT_V4 + DEFAULT_EGRESS_EXCEPT_V6,
        ready_timeout_s=settings.HEDGEROW_K8S_READY_TIMEOUT_S,
        max_concurrency=settings.HEDGEROW_K8S_MAX_CONCURRENCY,
        api_qps=settings.HEDGEROW_K8S_API_QPS,
        api_burst=settings.HEDGEROW_K8S_API_BURST,
        api_retries=settings.HEDGEROW_K8S_API_RETRIES,
        user_namespaces=settings.HEDGEROW_K8S_USER_NAMESPACES,
        run_as_user=settings.HEDGEROW_K8S_RUN_AS_USER or "auto",  # empty = the default
        read_only_root=settings.HEDGEROW_K8S_READ_ONLY_ROOT,
        not_ready_lost_s=settings.HEDGEROW_K8S_NOT_READY_LOST_S,
        node_lost_toleration_s=settings.HEDGEROW_K8S_NODE_LOST_TOLERATION_S,
        wait_stall_s=settings.HEDGEROW_K8S_WAIT_STALL_S,
        dns_cidrs=tuple(settings.HEDGEROW_K8S_DNS_CIDRS),
        dns_nameservers=tuple(settings.HEDGEROW_K8S_DNS_NAMESERVERS),
        agent_ingress_cidrs=tuple(settings.HEDGEROW_K8S_AGENT_INGRESS_CIDRS),
        informer_everywhere=settings.HEDGEROW_K8S_INFORMER_EVERYWHERE,
        protect_from_disruption=settings.HEDGEROW_K8S_PROTECT_FROM_DISRUPTION,
        resolver_ip=settings.HEDGEROW_K8S_RESOLVER_IP,
        resolver_port=settings.HEDGEROW_K8S_RESOLVER_PORT,
        cni=settings.HEDGEROW_K8S_CNI,
        snapshot_class=settings.HEDGEROW_K8S_SNAPSHOT_CLASS,
        snapshot_storage_class=settings.HEDGEROW_K8S_SNAPSHOT_STORAGE_CLASS,
        snapshot_ready_timeout_s=settings.HEDGEROW_K8S_SNAPSHOT_READY_TIMEOUT_S,
    )


def check_startup() -> KubernetesConfig:
    """The configuration, or ImproperlyConfigured with every reason it must not run
    sandboxes (no pod boundary, an injector image not pinned by digest)."""
    config = config_from_settings()
    refusals = startup_refusals(
        config,
        allow_no_boundary=settings.HEDGEROW_K8S_ALLOW_NO_BOUNDARY,
        allow_unpinned_injector=settings.HEDGEROW_K8S_ALLOW_UNPINNED_INJECTOR,
    )
    if refusals:
        raise ImproperlyConfigured(
            "the kubernetes backend refuses to start: " + "; and ".join(refusals)
        )
    return config


def api_client_from_settings(max_concurrency: int) -> client.ApiClient:
    """In-cluster service account when no kubeconfig is configured, else the file."""
    configuration = client.Configuration()
    if settings.HEDGEROW_K8S_KUBECONFIG:
        if not settings.HEDGEROW_K8S_AGENT_INGRESS_CIDRS:
            # outside the cluster the hot path goes straight to pod IPs, which the
            # namespace policy admits only from the control plane's own pods
            raise ImproperlyConfigured(
                "HEDGEROW_K8S_KUBECONFIG is set (a control plane outside the cluster) but "
                "HEDGEROW_K8S_AGENT_INGRESS_CIDRS is empty: the sandbox namespace's policy "
                "would drop every request to the agents. Set it to the addresses this "
                "control plane reaches pod IPs from (pod IPs must be routable to it), see "
                'docs/deploy-kubernetes.md "Control plane outside the cluster"'
            )
        kube_config.load_kube_config(
            config_file=settings.HEDGEROW_K8S_KUBECONFIG,
            context=settings.HEDGEROW_K8S_CONTEXT or None,
            client_configuration=configuration,
        )
    else:
        kube_config.load_incluster_config(client_configuration=configuration)
    # one pooled connection per concurrent call, plus the informer's watch
    configuration.connection_pool_maxsize = max_concurrency + 2
    # KubeApi retries with backoff itself; urllib3's own retries would hide them
    configuration.retries = False
    return client.ApiClient(configuration)


def check_permissions(api: KubeApi) -> None:
    """ImproperlyConfigured naming every permission this process's role needs and the
    API server says it lacks (SelfSubjectAccessReview), unless
    HEDGEROW_K8S_SKIP_PERMISSION_CHECK."""
    if settings.HEDGEROW_K8S_SKIP_PERMISSION_CHECK:
        return
    try:
        role = process_role(settings.HEDGEROW_K8S_PROCESS_ROLE)
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from exc
    refusal = permission_refusal(api, role)
    if refusal:
        raise ImproperlyConfigured("the kubernetes backend refuses to start: " + refusal)


def build_kubernetes_backend() -> KubernetesBackend:
    config = check_startup()
    api = KubeApi(api_client_from_settings(config.max_concurrency), config)
    check_permissions(api)
    return KubernetesBackend(config, api)
