"""The one settings module. Everything that varies comes from the environment."""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from apps.core.env import (
    env_bool,
    env_float,
    env_int,
    env_ints,
    env_list,
    env_str,
    local_redis_url,
    state_secret,
)
from controlplane.version import VERSION

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(env_str("HEDGEROW_STATE_DIR", str(BASE_DIR / ".state")))


def _secret_key() -> str:
    """The key signs sessions and derives every agent token, so a known default is
    refused. Order: the environment, then ``.state/secret_key`` (written once by
    ``make up``/``make test``), then a fixed key for tests only."""
    from_env = os.environ.get("HEDGEROW_SECRET_KEY", "")
    if from_env:
        return from_env
    key_file = STATE_DIR / "secret_key"
    if key_file.is_file():
        return key_file.read_text().strip()
    if "pytest" in sys.modules or "mypy" in sys.modules:  # tests and type checking only
        return "hedgerow-tests-only-not-secret"
    raise ImproperlyConfigured(
        "HEDGEROW_SECRET_KEY is not set (make up writes one to .state/secret_key)"
    )


SECRET_KEY = _secret_key()
DEBUG = env_bool("HEDGEROW_DEBUG", False)
ALLOWED_HOSTS = env_list("HEDGEROW_ALLOWED_HOSTS", ["*"])
CSRF_TRUSTED_ORIGINS = env_list("HEDGEROW_CSRF_TRUSTED_ORIGINS", [])

# The installation's name: every backend resource and Redis key carries it so the
# dev stack and concurrent test runs on one machine never touch each other's.
# Under pytest the default is per process, so a test run can never touch the dev stack.
HEDGEROW_INSTANCE = env_str(
    "HEDGEROW_INSTANCE", f"pytest{os.getpid()}" if "pytest" in sys.modules else "dev"
)

INSTALLED_APPS = [
    "daphne" if env_bool("HEDGEROW_USE_DAPHNE", False) else "channels",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "apps.tenancy",
    "apps.billing",
    "apps.sandboxes",
    "apps.trajectories",
    "apps.images",
    "apps.datasets",
    "apps.orchard",
    "apps.e2b",
    "frontend",
]
if INSTALLED_APPS[0] == "daphne":
    INSTALLED_APPS.insert(1, "channels")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "controlplane.middleware.RequestIdMiddleware",
    "controlplane.middleware.InputGuardMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "controlplane.context_processors.websocket_routes",
            ],
        },
    },
]

DATABASES = {
    "default": {
        # Django's backend, with a health check that needs no round trip when the
        # connection is quiet (controlplane/pgconn).
        "ENGINE": "controlplane.pgconn",
        "NAME": env_str("HEDGEROW_DB_NAME", "hedgerow"),
        "USER": env_str("HEDGEROW_DB_USER", "hedgerow"),
        # The environment's, else the one `make up` generated into .state/ (0600).
        "PASSWORD": state_secret("HEDGEROW_DB_PASSWORD", str(STATE_DIR), "db_password"),
        "HOST": env_str("HEDGEROW_DB_HOST", "127.0.0.1"),
        "PORT": env_int("HEDGEROW_DB_PORT", 55432),
        "CONN_MAX_AGE": env_int("HEDGEROW_DB_CONN_MAX_AGE", 60),
        "CONN_HEALTH_CHECKS": True,
        "TEST": {"NAME": env_str("HEDGEROW_TEST_DB_NAME", f"test_hedgerow_{HEDGEROW_INSTANCE}")},
    }
}
# A psycopg connection pool for the web process: under ASGI every request runs in a
# new thread, so CONN_MAX_AGE cannot keep a connection and each request would
# otherwise open one. Off by default (Celery's prefork children must not inherit a
# pool); scripts/stack.sh turns it on for uvicorn.
if env_bool("HEDGEROW_DB_POOL", False):
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # The pool checks a connection only after it sat idle (controlplane/dbpool.py), not
    # with an extra round trip on every checkout as CONN_HEALTH_CHECKS has it.
    DATABASES["default"]["ENGINE"] = "controlplane.pgpool"
    DATABASES["default"]["OPTIONS"] = {
        "pool": {"min_size": 2, "max_size": env_int("HEDGEROW_DB_POOL_MAX", 20), "timeout": 10}
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# HEDGEROW_REDIS_URL, else the local stack's Redis with its password from .state/.
REDIS_URL = local_redis_url(str(STATE_DIR))
REDIS_KEY_PREFIX = f"hedgerow:{HEDGEROW_INSTANCE}:"

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": REDIS_KEY_PREFIX,
    }
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": f"{REDIS_KEY_PREFIX}asgi", "capacity": 2000},
    }
}

# Celery: broker keys carry the instance prefix so concurrent installations and
# test runs sharing one Redis never consume each other's tasks.
CELERY_BROKER_URL = env_str("HEDGEROW_CELERY_BROKER_URL", REDIS_URL)
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": REDIS_KEY_PREFIX, "visibility_timeout": 600}
CELERY_RESULT_BACKEND = None
# Results are never stored (the database is the truth), so the (disabled) backend is
# one object per process. Celery's default makes one per thread, and under ASGI every
# request runs in a fresh thread: each enqueue scanned the installed packages' entry
# points to build it again (~3 ms of CPU per create and per delete).
CELERY_RESULT_BACKEND_THREAD_SAFE = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = f"{HEDGEROW_INSTANCE}.cold"
CELERY_TASK_ALWAYS_EAGER = env_bool("HEDGEROW_CELERY_EAGER", False)
CELERY_BEAT_SCHEDULE_FILENAME = str(STATE_DIR / "celerybeat-schedule")

AUTH_PASSWORD_VALIDATORS: list[dict[str, str]] = []
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "frontend" / "static"]
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.tenancy.auth.ApiKeyAuthentication",
        "apps.tenancy.auth.TenantSessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["apps.tenancy.permissions.HasTenantScope"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "apps.core.errors.exception_handler",
    # JSON bodies: bounded depth, no lone surrogates (apps/core/inputs.py).
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Hedgerow API",
    "DESCRIPTION": "Sandboxes for agent training and evaluation. Authenticate with "
    "`Authorization: Bearer <key>` or `X-API-Key: <key>`. Errors are "
    '`{"error": {"code", "message", "field"}}`.',
    "VERSION": VERSION,  # controlplane/version.py: one version for server, API, SDK
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI from drf-spectacular-sidecar's pinned copy in our static files, not a
    # CDN's @latest: the API docs page works on machines without internet.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # two choice sets are both called `kind`: name each after its model's choices
    "ENUM_NAME_OVERRIDES": {
        "StepKindEnum": "apps.trajectories.models.StepKind",
        "VerifierKindEnum": "apps.trajectories.models.VerifierKind",
    },
}

# --- Sandboxes -----------------------------------------------------------------
HEDGEROW_BACKEND = env_str("HEDGEROW_BACKEND", "local")  # local | kubernetes
HEDGEROW_LOCAL_ISOLATION = env_str("HEDGEROW_LOCAL_ISOLATION", "auto")  # auto|netns|none
HEDGEROW_LOCAL_SUBNET = env_str("HEDGEROW_LOCAL_SUBNET", "")
# Without HEDGEROW_LOCAL_SUBNET: the size of the subnet claimed from the pool, which caps
# live sandboxes (/24: 253; /21, as `make up` sets it: 2045, on four bridges).
# docs/operations.md "Density"
HEDGEROW_LOCAL_SUBNET_PREFIX = env_int("HEDGEROW_LOCAL_SUBNET_PREFIX", 24)
# Ports per bridge (1..1023, a Linux bridge's limit): the subnet is cut into blocks of the
# largest power of two not above it, one bridge each. Lower only to try several bridges
# with few sandboxes (bench/density.py --bridge-ports).
HEDGEROW_LOCAL_BRIDGE_PORTS = env_int("HEDGEROW_LOCAL_BRIDGE_PORTS", 1023)
HEDGEROW_AGENT_PYTHON = env_str("HEDGEROW_AGENT_PYTHON", "/usr/bin/python3")
# How isolated sandboxes' agents start: zygote (forked from an imported process: no
# interpreter start per sandbox), exec (python3 -m podagent as bwrap's payload), or
# auto (zygote when gcc can build its pause binary). docs/local-backend.md
HEDGEROW_LOCAL_AGENT_LAUNCH = env_str("HEDGEROW_LOCAL_AGENT_LAUNCH", "auto")
# The interpreter the agent zygote (and so every zygote-started agent) runs; "": the
# control plane's own; "auto" (make up's setting, scripts/stack-defaults.env): a
# CPython 3.12 when the machine has one (backends/local/agent_python.py). An idle
# agent's private pages are CPython's refcount writes: Python >= 3.12 (immortal
# objects) copies ~0.6 MiB fewer per agent. docs/local-backend.md
HEDGEROW_LOCAL_ZYGOTE_PYTHON = env_str("HEDGEROW_LOCAL_ZYGOTE_PYTHON", "")
# Exec launch leaves the agent killable by commands: refused unless opted into.
HEDGEROW_LOCAL_ALLOW_UNPROTECTED_EXEC_LAUNCH = env_bool(
    "HEDGEROW_LOCAL_ALLOW_UNPROTECTED_EXEC_LAUNCH", False
)
# Egress allowlists (docs/egress.md): the upstream DNS server of the instance's resolver
# ("ip" or "ip:port"; "": the host's first IPv4 nameserver) and how long an address it
# handed out stays allowed past the record's TTL.
HEDGEROW_DNS_UPSTREAM = env_str("HEDGEROW_DNS_UPSTREAM", "")
HEDGEROW_DNS_GRACE_S = env_int("HEDGEROW_DNS_GRACE_S", 30)
# Egress "all" (docs/egress.md "Always denied"): private ranges (10/8, 172.16/12,
# 192.168/16, 100.64/10, 192.0.0/24, 198.18/15) are refused unless listed here (comma
# list of IPv4 CIDRs), or all of them with HEDGEROW_EGRESS_ALLOW_PRIVATE=1.
HEDGEROW_EGRESS_PRIVATE_ALLOW = [
    c.strip() for c in env_str("HEDGEROW_EGRESS_PRIVATE_ALLOW", "").split(",") if c.strip()
]
for _cidr in HEDGEROW_EGRESS_PRIVATE_ALLOW:
    try:
        ipaddress.IPv4Network(_cidr)
    except ValueError as _exc:
        raise ImproperlyConfigured(f"HEDGEROW_EGRESS_PRIVATE_ALLOW: {_cidr!r}: {_exc}") from None
HEDGEROW_EGRESS_ALLOW_PRIVATE = env_bool("HEDGEROW_EGRESS_ALLOW_PRIVATE", False)
# A built agent bundle (scripts/build_agent_bundle.sh): lets the local backend run the
# agent in imported images without python3. Empty: such images are refused.
HEDGEROW_AGENT_BUNDLE = env_str("HEDGEROW_AGENT_BUNDLE", "")
# Sandbox storage (docs/operations.md#sandbox-disk): isolated sandboxes write only to a
# loop-mounted btrfs of this size, made on first use (0: min(64 GiB, half the free
# space of the state dir's filesystem)); each sandbox's /workspace and /tmp together
# get HEDGEROW_SANDBOX_DISK_MIB of it at most.
HEDGEROW_SANDBOX_DISK_SIZE_MIB = env_int("HEDGEROW_SANDBOX_DISK_SIZE_MIB", 0)
HEDGEROW_SANDBOX_DISK_MIB = env_int("HEDGEROW_SANDBOX_DISK_MIB", 2048)
if HEDGEROW_SANDBOX_DISK_MIB < 1 or not (
    HEDGEROW_SANDBOX_DISK_SIZE_MIB == 0 or HEDGEROW_SANDBOX_DISK_SIZE_MIB >= 256
):
    raise ImproperlyConfigured(
        "HEDGEROW_SANDBOX_DISK_MIB must be >= 1 and HEDGEROW_SANDBOX_DISK_SIZE_MIB 0 or >= 256"
    )
# OCI images (docs/images.md): one content-addressed store per machine, shared by every
# instance on it; the free space a pull must leave; the cache size above which unused
# images are collected, least recently used first (0: only what no image uses).
HEDGEROW_IMAGE_STORE = env_str("HEDGEROW_IMAGE_STORE", "/var/lib/hedgerow/images")


def _registry_list(name: str) -> list[str]:
    out = [r.strip().lower() for r in env_str(name, "").split(",") if r.strip()]
    bad = [r for r in out if not re.fullmatch(r"(?:[a-z0-9.-]+|\[[0-9a-f:]+\])(?::[0-9]{1,5})?", r)]
    if bad:
        raise ImproperlyConfigured(f"{name}: not host or host:port entries: {', '.join(bad)}")
    return out


# The registry egress policy (docs/security.md "Registry egress"): registries whose host
# is, or resolves to, a loopback, link-local, private, CGNAT, unique-local, multicast
# or otherwise non-public address are refused (`registry_forbidden`) unless listed in
# HEDGEROW_REGISTRY_ALLOW (host: any port; host:port: that port) or in
# HEDGEROW_INSECURE_REGISTRIES (the only ones reached over plain HTTP / unverified TLS;
# loopback is not implied). HEDGEROW_REGISTRY_DENY refuses hosts whatever they resolve
# to; HEDGEROW_REGISTRY_ALLOW_PRIVATE=1 turns the address check off.
HEDGEROW_REGISTRY_ALLOW = _registry_list("HEDGEROW_REGISTRY_ALLOW")
HEDGEROW_INSECURE_REGISTRIES = _registry_list("HEDGEROW_INSECURE_REGISTRIES")
HEDGEROW_REGISTRY_DENY = _registry_list("HEDGEROW_REGISTRY_DENY")
HEDGEROW_REGISTRY_ALLOW_PRIVATE = env_bool("HEDGEROW_REGISTRY_ALLOW_PRIVATE", False)
# Not root, skopeo gets no network namespace of its own (images/jail.py), so a permitted
# registry's redirect or token realm on loopback would reach this machine's services:
# registry pulls are then refused unless this is set (docs/security.md "Registry egress").
HEDGEROW_REGISTRY_ALLOW_UNPROTECTED_LOOPBACK = env_bool(
    "HEDGEROW_REGISTRY_ALLOW_UNPROTECTED_LOOPBACK", False
)
HEDGEROW_IMAGE_MIN_FREE_MIB = env_int("HEDGEROW_IMAGE_MIN_FREE_MIB", 2048)
HEDGEROW_IMAGE_CACHE_MIB = env_int("HEDGEROW_IMAGE_CACHE_MIB", 50 * 1024)
# How often the beat collects the image cache down to HEDGEROW_IMAGE_CACHE_MIB.
HEDGEROW_IMAGE_COLLECT_INTERVAL_S = env_float("HEDGEROW_IMAGE_COLLECT_INTERVAL_S", 600.0)
HEDGEROW_READY_TIMEOUT_S = env_float("HEDGEROW_READY_TIMEOUT_S", 30.0)
HEDGEROW_PENDING_TIMEOUT_S = env_float("HEDGEROW_PENDING_TIMEOUT_S", 120.0)
# A fork's K children are provisioned by this many Celery tasks (one per worker
# process: HEDGEROW_WORKER_CONCURRENCY, as scripts/stack.sh starts the worker), not K
# tasks; each runs its share on HEDGEROW_FORK_THREADS threads, so a provision's waits
# (zygote, agent) overlap; each thread opens its own database and Redis connection.
# 2 measured best on this 2-core machine (docs/benchmarks.md, "A fork through the
# control plane, batched"); 1 provisions a share's children in turn.
HEDGEROW_FORK_TASKS = env_int("HEDGEROW_FORK_TASKS", env_int("HEDGEROW_WORKER_CONCURRENCY", 4))
HEDGEROW_FORK_THREADS = env_int("HEDGEROW_FORK_THREADS", 2)
HEDGEROW_DEFAULT_TTL_S = env_int("HEDGEROW_DEFAULT_TTL_S", 3600)
HEDGEROW_MAX_TTL_S = env_int("HEDGEROW_MAX_TTL_S", 24 * 3600)
HEDGEROW_MAX_LIVE_SANDBOXES = env_int("HEDGEROW_MAX_LIVE_SANDBOXES", 0)  # 0 = unlimited
HEDGEROW_REAPER_INTERVAL_S = env_float("HEDGEROW_REAPER_INTERVAL_S", 10.0)
HEDGEROW_MAX_UPLOAD_BYTES = env_int("HEDGEROW_MAX_UPLOAD_BYTES", 512 * 1024 * 1024)
HEDGEROW_EXEC_OUTPUT_WINDOW = env_int("HEDGEROW_EXEC_OUTPUT_WINDOW", 1024 * 1024)
HEDGEROW_EXEC_DEFAULT_TIMEOUT_S = env_float("HEDGEROW_EXEC_DEFAULT_TIMEOUT_S", 600.0)
# Per-kind concurrency limits (docs/billing.md "Limits per operation kind"), beside the
# tenant quota's exec limits; 0 = unlimited. An exec whose timeout (its own or the
# default above) exceeds HEDGEROW_EXEC_LONG_AFTER_S is a *long* exec: it is counted in
# its own pools, so test runs cannot take the slots short execs need, and weighs its
# timeout in seconds against the execution-time limits.
HEDGEROW_EXEC_LONG_AFTER_S = env_float("HEDGEROW_EXEC_LONG_AFTER_S", 60.0)
HEDGEROW_EXEC_MAX_PER_SANDBOX = env_int("HEDGEROW_EXEC_MAX_PER_SANDBOX", 256)
HEDGEROW_EXEC_MAX_PER_INSTALLATION = env_int("HEDGEROW_EXEC_MAX_PER_INSTALLATION", 0)
HEDGEROW_LONG_EXEC_MAX_PER_SANDBOX = env_int("HEDGEROW_LONG_EXEC_MAX_PER_SANDBOX", 32)
HEDGEROW_LONG_EXEC_MAX_PER_TENANT = env_int("HEDGEROW_LONG_EXEC_MAX_PER_TENANT", 0)
HEDGEROW_LONG_EXEC_MAX_PER_INSTALLATION = env_int("HEDGEROW_LONG_EXEC_MAX_PER_INSTALLATION", 0)
HEDGEROW_LONG_EXEC_SECONDS_PER_TENANT = env_int("HEDGEROW_LONG_EXEC_SECONDS_PER_TENANT", 0)
HEDGEROW_LONG_EXEC_SECONDS_PER_INSTALLATION = env_int(
    "HEDGEROW_LONG_EXEC_SECONDS_PER_INSTALLATION", 0
)
# File transfers (uploads and downloads, files and trees) in flight, and their bytes.
HEDGEROW_FILE_TRANSFERS_PER_SANDBOX = env_int("HEDGEROW_FILE_TRANSFERS_PER_SANDBOX", 8)
HEDGEROW_FILE_TRANSFERS_PER_TENANT = env_int("HEDGEROW_FILE_TRANSFERS_PER_TENANT", 0)
HEDGEROW_FILE_TRANSFERS_PER_INSTALLATION = env_int("HEDGEROW_FILE_TRANSFERS_PER_INSTALLATION", 64)
HEDGEROW_FILE_BYTES_PER_TENANT = env_int("HEDGEROW_FILE_BYTES_PER_TENANT", 0)
HEDGEROW_FILE_BYTES_PER_INSTALLATION = env_int("HEDGEROW_FILE_BYTES_PER_INSTALLATION", 0)
# Plain REST execs answered on the event loop in front of Django
# (apps/sandboxes/api/exec_fastpath.py); off: every exec goes through the DRF view.
HEDGEROW_EXEC_FAST_PATH = env_bool("HEDGEROW_EXEC_FAST_PATH", True)
# Uploads with a Content-Length admitted before their body is read and streamed straight
# to the agent on the event loop, downloads streamed from the agent without a thread hop
# per chunk (apps/sandboxes/api/files_fastpath.py); off: through Django, which reads an
# upload's whole body into a temporary file first.
HEDGEROW_FILES_FAST_PATH = env_bool("HEDGEROW_FILES_FAST_PATH", True)
# A file transfer's next piece waits while a short exec is in flight in the same web
# process, at most this many milliseconds per MiB moved (apps/sandboxes/api/
# transfer_gate.py; 0, the default: transfers never wait; docs/benchmarks.md has the
# A/B that left it off).
# On by default since the quiet full-size A/B of 2026-12-06 10:44 (docs/benchmarks.md,
# "The transfer gate on a quiet machine"): 0 turns it off.
HEDGEROW_TRANSFER_YIELD_MS = env_float("HEDGEROW_TRANSFER_YIELD_MS", 50.0)
# The web process's cyclic GC (controlplane/webgc.py): freeze the start-up heap, and
# the collector's generation thresholds (Python's default: 700,10,10).
HEDGEROW_WEB_GC_FREEZE = env_bool("HEDGEROW_WEB_GC_FREEZE", True)
HEDGEROW_WEB_GC_THRESHOLD = env_ints("HEDGEROW_WEB_GC_THRESHOLD", (10000, 10, 10))
HEDGEROW_MAX_CPU_MILLIS = env_int("HEDGEROW_MAX_CPU_MILLIS", 8000)
HEDGEROW_MAX_MEMORY_MIB = env_int("HEDGEROW_MAX_MEMORY_MIB", 32768)
HEDGEROW_PUBLIC_URL = env_str("HEDGEROW_PUBLIC_URL", "http://127.0.0.1:8000")

# --- Orchard Env compatibility (/orchard, docs/orchard.md) -------------------------
# Longest a `wait: true` exec holds its request before answering `running` (the client
# then polls): kept below common client HTTP timeouts so none times out and resubmits.
HEDGEROW_ORCHARD_EXEC_WAIT_S = env_float("HEDGEROW_ORCHARD_EXEC_WAIT_S", 25.0)
# Stands in for container images the backend does not have ("" = refuse them).
HEDGEROW_ORCHARD_DEFAULT_IMAGE = env_str("HEDGEROW_ORCHARD_DEFAULT_IMAGE", "host")
# The image E2B's default template `base` names (docs/e2b.md).
HEDGEROW_E2B_BASE_IMAGE = env_str("HEDGEROW_E2B_BASE_IMAGE", "host")
# How long an E2B create waits for its sandbox to be ready (below the SDK's 60 s
# default request timeout, so the SDK never gives up first and retries).
HEDGEROW_E2B_CREATE_WAIT_S = env_float("HEDGEROW_E2B_CREATE_WAIT_S", 55.0)

# --- Realtime: exec streams and PTY (docs/realtime.md) --------------------------
HEDGEROW_STREAM_REPLAY_FRAMES = env_int("HEDGEROW_STREAM_REPLAY_FRAMES", 512)
# A replay buffer expires this long after its last frame (never longer: Redis memory).
HEDGEROW_STREAM_REPLAY_TTL_S = env_int("HEDGEROW_STREAM_REPLAY_TTL_S", 600)
# Frame bytes a replay buffer keeps per operation; beyond it the oldest frames go and
# a subscriber asking for them gets an exec.gap frame (docs/realtime.md).
HEDGEROW_STREAM_REPLAY_MAX_BYTES = env_int("HEDGEROW_STREAM_REPLAY_MAX_BYTES", 1024 * 1024)
HEDGEROW_PTY_MAX_PER_SANDBOX = env_int("HEDGEROW_PTY_MAX_PER_SANDBOX", 4)
HEDGEROW_PTY_MAX_PER_TENANT = env_int("HEDGEROW_PTY_MAX_PER_TENANT", 32)
HEDGEROW_PTY_MAX_PER_INSTALLATION = env_int("HEDGEROW_PTY_MAX_PER_INSTALLATION", 0)  # 0 = unlimited
HEDGEROW_WS_MAX_MESSAGES_PER_S = env_int("HEDGEROW_WS_MAX_MESSAGES_PER_S", 200)
# How often an open websocket re-checks its key or session (revocation, expiry, role,
# team disabled, membership removed, sign-out); it closes with 4401/4403 within this.
HEDGEROW_WS_REVALIDATE_S = env_float("HEDGEROW_WS_REVALIDATE_S", 3.0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "apps.core.logging.JsonFormatter"}},
    "filters": {"request_id": {"()": "apps.core.logging.RequestIdFilter"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "filters": ["request_id"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("HEDGEROW_LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"level": "ERROR"},
        # httpx logs every request's full URL at INFO: a webhook's URL may carry a token
        # (docs/billing.md, budget notices), so only its warnings and errors are kept.
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}

CELERY_BEAT_SCHEDULE = {
    "reap-sandboxes": {
        "task": "apps.sandboxes.tasks.reap_sandboxes",
        "schedule": HEDGEROW_REAPER_INTERVAL_S,
    },
}

# --- Reconciliation, leak audit, metrics (operations) ---------------------------
HEDGEROW_RECONCILE_INTERVAL_S = env_float("HEDGEROW_RECONCILE_INTERVAL_S", 30.0)
HEDGEROW_AUDIT_INTERVAL_S = env_float("HEDGEROW_AUDIT_INTERVAL_S", 3600.0)
HEDGEROW_AUDIT_PERIOD_S = env_float("HEDGEROW_AUDIT_PERIOD_S", 24 * 3600.0)
# A TTL reap is a backstop: above this share of ended sandboxes the audit warns.
HEDGEROW_AUDIT_TTL_WARN_SHARE = env_float("HEDGEROW_AUDIT_TTL_WARN_SHARE", 0.10)
# A team's own audits (POST /api/v1/audits) run in a worker, one at a time per team and
# at most one per this many seconds (429 audit_throttled with Retry-After).
HEDGEROW_AUDIT_MIN_INTERVAL_S = env_float("HEDGEROW_AUDIT_MIN_INTERVAL_S", 60.0)
# Operations still `running` this long after the web process should have finished
# them are asked for at the agent (recovered) or marked interrupted.
HEDGEROW_OPERATION_RECOVERY_AFTER_S = env_float("HEDGEROW_OPERATION_RECOVERY_AFTER_S", 30.0)
# Bearer token for Prometheus scrapes of /metrics (staff sessions work too); empty: staff only.
HEDGEROW_METRICS_TOKEN = env_str("HEDGEROW_METRICS_TOKEN", "")
# A sandbox's metrics history on the server (apps/sandboxes/services/sandbox_metrics.py):
# each read of its metrics is kept (at most one per MIN_GAP_S), newest SAMPLES of them
# (360 at the page's 5 s = 30 min), expiring TTL_S after the last; dropped on destroy.
HEDGEROW_METRICS_HISTORY_SAMPLES = env_int("HEDGEROW_METRICS_HISTORY_SAMPLES", 360)
HEDGEROW_METRICS_HISTORY_MIN_GAP_S = env_float("HEDGEROW_METRICS_HISTORY_MIN_GAP_S", 4.0)
HEDGEROW_METRICS_HISTORY_TTL_S = env_float("HEDGEROW_METRICS_HISTORY_TTL_S", 3600.0)
# The metric deltas the triggers write are folded by every scrape and by this task,
# so they stay few when nobody scrapes (apps/sandboxes/services/metrics_tally.py).
CELERY_BEAT_SCHEDULE["fold-metrics"] = {
    "task": "apps.sandboxes.tasks.fold_metrics",
    "schedule": 60.0,
}
CELERY_BEAT_SCHEDULE["reconcile-sandboxes"] = {
    "task": "apps.sandboxes.tasks.reconcile_sandboxes",
    "schedule": HEDGEROW_RECONCILE_INTERVAL_S,
}
CELERY_BEAT_SCHEDULE["audit-leaks"] = {
    "task": "apps.sandboxes.tasks.audit_leaks",
    "schedule": HEDGEROW_AUDIT_INTERVAL_S,
}
# Episodes closed within the loss-detection grace are re-attributed this often.
HEDGEROW_REATTRIBUTE_INTERVAL_S = env_float("HEDGEROW_REATTRIBUTE_INTERVAL_S", 20.0)
CELERY_BEAT_SCHEDULE["reattribute-episodes"] = {
    "task": "apps.trajectories.tasks.reattribute_recent_episodes",
    "schedule": HEDGEROW_REATTRIBUTE_INTERVAL_S,
}
# The list page's numbers (issue 20): final episode costs stored, tally deltas folded.
CELERY_BEAT_SCHEDULE["settle-episode-costs"] = {
    "task": "apps.trajectories.tasks.settle_episode_costs",
    "schedule": 60.0,
}
# --- Team activity log and API key rotation (docs/security.md#team-activity) -------
# Activity entries older than this are deleted by a daily beat task.
HEDGEROW_ACTIVITY_RETENTION_DAYS = env_int("HEDGEROW_ACTIVITY_RETENTION_DAYS", 365)
CELERY_BEAT_SCHEDULE["purge-activity"] = {
    "task": "apps.tenancy.tasks.purge_activity",
    "schedule": 24 * 3600.0,
}
# A rotated key's old secret keeps working this long unless the rotation names a grace
# (0 to HEDGEROW_KEY_ROTATION_MAX_GRACE_S seconds).
HEDGEROW_KEY_ROTATION_GRACE_S = env_int("HEDGEROW_KEY_ROTATION_GRACE_S", 24 * 3600)
HEDGEROW_KEY_ROTATION_MAX_GRACE_S = env_int("HEDGEROW_KEY_ROTATION_MAX_GRACE_S", 30 * 24 * 3600)
CELERY_BEAT_SCHEDULE["recover-operations"] = {
    "task": "apps.sandboxes.tasks.recover_operations",
    "schedule": HEDGEROW_OPERATION_RECOVERY_AFTER_S,
}
CELERY_BEAT_SCHEDULE["collect-image-cache"] = {
    "task": "apps.sandboxes.tasks.collect_image_cache",
    "schedule": HEDGEROW_IMAGE_COLLECT_INTERVAL_S,
}

# --- Retention (docs/operations.md "Retention") ------------------------------------
# Ended sandboxes' operation output windows are pruned after this many days, and
# their operation rows replaced by summaries after that many (0: never). The ledger,
# usage records and audits are never pruned.
HEDGEROW_RETENTION_OUTPUT_DAYS = env_float("HEDGEROW_RETENTION_OUTPUT_DAYS", 30.0)
HEDGEROW_RETENTION_OPERATION_DAYS = env_float("HEDGEROW_RETENTION_OPERATION_DAYS", 90.0)
# A run's bound: at most MAX_BATCHES transactions of at most BATCH operations each.
HEDGEROW_RETENTION_BATCH = env_int("HEDGEROW_RETENTION_BATCH", 500)
HEDGEROW_RETENTION_MAX_BATCHES = env_int("HEDGEROW_RETENTION_MAX_BATCHES", 20)
HEDGEROW_RETENTION_INTERVAL_S = env_float("HEDGEROW_RETENTION_INTERVAL_S", 3600.0)
CELERY_BEAT_SCHEDULE["apply-retention"] = {
    "task": "apps.sandboxes.tasks.apply_retention",
    "schedule": HEDGEROW_RETENTION_INTERVAL_S,
}

# --- Kubernetes backend (HEDGEROW_BACKEND=kubernetes; docs/deploy-kubernetes.md) -----
# Empty kubeconfig: in-cluster config (the control plane runs in the cluster).
HEDGEROW_K8S_KUBECONFIG = env_str("HEDGEROW_K8S_KUBECONFIG", "")
HEDGEROW_K8S_CONTEXT = env_str("HEDGEROW_K8S_CONTEXT", "")
HEDGEROW_K8S_NAMESPACE = env_str("HEDGEROW_K8S_NAMESPACE", "hedgerow-sandboxes")
HEDGEROW_K8S_CONTROLPLANE_NAMESPACE = env_str("HEDGEROW_K8S_CONTROLPLANE_NAMESPACE", "hedgerow")
HEDGEROW_K8S_INJECTOR_IMAGE = env_str(
    "HEDGEROW_K8S_INJECTOR_IMAGE", "hedgerow-agent-injector:latest"
)
HEDGEROW_K8S_IMAGES = env_list(
    "HEDGEROW_K8S_IMAGES", ["python:3.12-slim", "debian:bookworm-slim", "ubuntu:24.04"]
)
HEDGEROW_K8S_DEFAULT_IMAGE = env_str("HEDGEROW_K8S_DEFAULT_IMAGE", "python:3.12-slim")
HEDGEROW_K8S_RUNTIME_CLASS = env_str("HEDGEROW_K8S_RUNTIME_CLASS", "")  # gvisor, kata, …
HEDGEROW_K8S_NODE_SELECTOR = env_str("HEDGEROW_K8S_NODE_SELECTOR", "{}")  # JSON object
HEDGEROW_K8S_TOLERATIONS = env_str("HEDGEROW_K8S_TOLERATIONS", "[]")  # JSON list
HEDGEROW_K8S_IMAGE_PULL_SECRETS = env_list("HEDGEROW_K8S_IMAGE_PULL_SECRETS", [])
HEDGEROW_K8S_CAPABILITIES = env_list("HEDGEROW_K8S_CAPABILITIES", [])  # [] = the default set
HEDGEROW_K8S_EGRESS_EXCEPT = env_list("HEDGEROW_K8S_EGRESS_EXCEPT", [])  # [] = the default set
HEDGEROW_K8S_READY_TIMEOUT_S = env_float("HEDGEROW_K8S_READY_TIMEOUT_S", 120.0)
HEDGEROW_K8S_MAX_CONCURRENCY = env_int("HEDGEROW_K8S_MAX_CONCURRENCY", 8)
# Kubernetes API requests per second per process (average; 0: unlimited) and burst
HEDGEROW_K8S_API_QPS = env_float("HEDGEROW_K8S_API_QPS", 20.0)
HEDGEROW_K8S_API_BURST = env_int("HEDGEROW_K8S_API_BURST", 40)
HEDGEROW_K8S_API_RETRIES = env_int("HEDGEROW_K8S_API_RETRIES", 5)
# The sandbox pod's boundary (docs/deploy-kubernetes.md, "Pod security"): a user
# namespace per pod (hostUsers: false; false only for clusters without the feature),
# who the sandbox runs as (auto | image | nonroot | <uid>), and a read-only root.
HEDGEROW_K8S_USER_NAMESPACES = env_bool("HEDGEROW_K8S_USER_NAMESPACES", True)
HEDGEROW_K8S_RUN_AS_USER = env_str("HEDGEROW_K8S_RUN_AS_USER", "auto")
HEDGEROW_K8S_READ_ONLY_ROOT = env_bool("HEDGEROW_K8S_READ_ONLY_ROOT", False)
# Runtime behaviour (docs/deploy-kubernetes.md "Runtime behaviour"): how long a pod may
# stay not Ready before its sandbox is lost, how long pods tolerate a lost node, when a
# provision stops trusting the informer and reads its pod, sandbox DNS resolvers
# (CIDRs reachable on port 53; nameservers = dnsPolicy None), and the sources outside
# the cluster (a control plane run with a kubeconfig) allowed to reach agents.
HEDGEROW_K8S_NOT_READY_LOST_S = env_float("HEDGEROW_K8S_NOT_READY_LOST_S", 60.0)
HEDGEROW_K8S_NODE_LOST_TOLERATION_S = env_int("HEDGEROW_K8S_NODE_LOST_TOLERATION_S", 30)
HEDGEROW_K8S_WAIT_STALL_S = env_float("HEDGEROW_K8S_WAIT_STALL_S", 10.0)
HEDGEROW_K8S_DNS_CIDRS = env_list("HEDGEROW_K8S_DNS_CIDRS", [])
HEDGEROW_K8S_DNS_NAMESERVERS = env_list("HEDGEROW_K8S_DNS_NAMESERVERS", [])
HEDGEROW_K8S_AGENT_INGRESS_CIDRS = env_list("HEDGEROW_K8S_AGENT_INGRESS_CIDRS", [])
# egress allowlists (docs/egress.md "Kubernetes"): the in-cluster resolver's Service
# ClusterIP ("" refuses allowlists), the port its pods listen on, and "cilium" to
# render CiliumNetworkPolicy toFQDNs rules as well
HEDGEROW_K8S_RESOLVER_IP = env_str("HEDGEROW_K8S_RESOLVER_IP", "")
HEDGEROW_K8S_RESOLVER_PORT = env_int("HEDGEROW_K8S_RESOLVER_PORT", 5353)
HEDGEROW_K8S_CNI = env_str("HEDGEROW_K8S_CNI", "")
# false (default): one LIST+WATCH of the sandbox namespace per installation, the
# watcher's; true: every worker and web process runs a pod informer of its own
HEDGEROW_K8S_INFORMER_EVERYWHERE = env_bool("HEDGEROW_K8S_INFORMER_EVERYWHERE", False)
# Refusals at start (docs/deploy-kubernetes.md "Pod security", "Images"): neither user
# namespaces nor a runtime class, or an injector image not pinned by digest, stop every
# process unless accepted explicitly here.
HEDGEROW_K8S_ALLOW_NO_BOUNDARY = env_bool("HEDGEROW_K8S_ALLOW_NO_BOUNDARY", False)
HEDGEROW_K8S_ALLOW_UNPINNED_INJECTOR = env_bool("HEDGEROW_K8S_ALLOW_UNPINNED_INJECTOR", False)
# Each process asks the API server (SelfSubjectAccessReview) for the permissions its
# role needs when it builds the backend; 1 skips it. The role is read from the command
# line unless set (web, watcher, worker).
HEDGEROW_K8S_SKIP_PERMISSION_CHECK = env_bool("HEDGEROW_K8S_SKIP_PERMISSION_CHECK", False)
HEDGEROW_K8S_PROCESS_ROLE = os.environ.get("HEDGEROW_K8S_PROCESS_ROLE", "")
# safe-to-evict "false" / karpenter.sh/do-not-disrupt "true" on sandbox pods (true), or
# safe-to-evict "true" (false): docs/deploy-kubernetes.md "Autoscalers"
HEDGEROW_K8S_PROTECT_FROM_DISRUPTION = env_bool("HEDGEROW_K8S_PROTECT_FROM_DISRUPTION", True)
# Snapshots on Kubernetes (docs/snapshots.md "Kubernetes"): the VolumeSnapshotClass of
# captures ("" = none: snapshots_unsupported), the StorageClass of each sandbox's state
# claim ("" = the cluster default), how long a capture waits for readyToUse.
HEDGEROW_K8S_SNAPSHOT_CLASS = env_str("HEDGEROW_K8S_SNAPSHOT_CLASS", "")
HEDGEROW_K8S_SNAPSHOT_STORAGE_CLASS = env_str("HEDGEROW_K8S_SNAPSHOT_STORAGE_CLASS", "")
HEDGEROW_K8S_SNAPSHOT_READY_TIMEOUT_S = env_float("HEDGEROW_K8S_SNAPSHOT_READY_TIMEOUT_S", 300.0)

# --- Quotas, admission queue and metering (apps/billing, apps/sandboxes/admission) ---
# A queued sandbox not admitted within this long fails with reason `queue_timeout`.
HEDGEROW_QUEUE_TIMEOUT_S = env_int("HEDGEROW_QUEUE_TIMEOUT_S", 3600)
# Backstop for the drain that runs on every sandbox end (a drain racing another can skip).
HEDGEROW_ADMISSION_SWEEP_S = env_float("HEDGEROW_ADMISSION_SWEEP_S", 5.0)
HEDGEROW_USAGE_ROLLUP_S = env_float("HEDGEROW_USAGE_ROLLUP_S", 600.0)
CELERY_BEAT_SCHEDULE["admission-sweep"] = {
    "task": "apps.sandboxes.tasks.admission_sweep",
    "schedule": HEDGEROW_ADMISSION_SWEEP_S,
}
# The minutely usage sweep looks at sandboxes that moved in this window (the ledger's
# `at` index: its cost follows the rate of change); the daily one at all of them.
HEDGEROW_USAGE_SWEEP_LOOKBACK_S = env_float("HEDGEROW_USAGE_SWEEP_LOOKBACK_S", 900.0)
CELERY_BEAT_SCHEDULE["usage-sweep"] = {
    "task": "apps.sandboxes.tasks.usage_sweep",
    "schedule": 60.0,
}
CELERY_BEAT_SCHEDULE["usage-sweep-full"] = {
    "task": "apps.sandboxes.tasks.usage_sweep",
    "schedule": 24 * 3600.0,
    "kwargs": {"full": True},
}
# Budget notices (docs/billing.md): how often month-to-date spend is compared with each
# team's alert and budgets (a crossing is recorded once a month and POSTed to the
# owners' webhook, if set, with this timeout). Private/loopback webhook targets are
# refused unless HEDGEROW_WEBHOOK_ALLOW_PRIVATE (development only).
HEDGEROW_BUDGET_NOTICE_INTERVAL_S = env_float("HEDGEROW_BUDGET_NOTICE_INTERVAL_S", 60.0)
HEDGEROW_WEBHOOK_TIMEOUT_S = env_float("HEDGEROW_WEBHOOK_TIMEOUT_S", 5.0)
HEDGEROW_WEBHOOK_ALLOW_PRIVATE = env_bool("HEDGEROW_WEBHOOK_ALLOW_PRIVATE", False)
CELERY_BEAT_SCHEDULE["budget-notices"] = {
    "task": "apps.billing.tasks.budget_notices_check",
    "schedule": HEDGEROW_BUDGET_NOTICE_INTERVAL_S,
}
CELERY_BEAT_SCHEDULE["usage-rollup"] = {
    "task": "apps.billing.tasks.usage_rollup",
    "schedule": HEDGEROW_USAGE_ROLLUP_S,
}

# A `requested` sandbox no worker picked up after this long (its task was lost with the
# broker) is enqueued again by the reconciler.
HEDGEROW_REQUEUE_AFTER_S = env_float("HEDGEROW_REQUEUE_AFTER_S", 30.0)

# --- Warm pool (docs/operations.md "Warm pool") ----------------------------------
# Started sandboxes kept ahead of demand, per shape: "IMAGE:CPU:MEMORY:NETWORK=COUNT"
# entries separated by commas, e.g. "host:1000m:1024Mi:none=50" (NETWORK is none or
# egress). Empty (the default): no pool, every create takes the cold path.
HEDGEROW_WARM_POOL = env_str("HEDGEROW_WARM_POOL", "")
# At most this many members start at once (they share the worker with tenants' own
# provisioning, so this bounds what the pool can take from them).
HEDGEROW_WARM_POOL_MAX_WARMING = env_int("HEDGEROW_WARM_POOL_MAX_WARMING", 2)
# After a member fails to start, its shape is not refilled for this long.
HEDGEROW_WARM_POOL_BACKOFF_S = env_float("HEDGEROW_WARM_POOL_BACKOFF_S", 30.0)
HEDGEROW_WARM_POOL_REFILL_S = env_float("HEDGEROW_WARM_POOL_REFILL_S", 10.0)
# Refill only once claims (and misses) have been quiet this long: members started during
# a burst cost what the cold path costs and compete with the burst's own work, while
# they are only needed after it.
HEDGEROW_WARM_POOL_REFILL_QUIET_S = env_float("HEDGEROW_WARM_POOL_REFILL_QUIET_S", 5.0)
# ...but a refill held back by claims this long goes ahead anyway (a steady stream of
# claims is never quiet; the pool must not sit empty forever).
HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S = env_float("HEDGEROW_WARM_POOL_REFILL_MAX_DEFER_S", 60.0)
CELERY_BEAT_SCHEDULE["warm-pool-refill"] = {
    "task": "apps.sandboxes.tasks.warm_pool_refill",
    "schedule": HEDGEROW_WARM_POOL_REFILL_S,
}

# --- Datasets and task difficulty (docs/datasets.md) ----------------------------------
# The Beta prior of every (task, policy family) posterior, and the factor old counts are
# multiplied by each time the family's policy version changes (1: never forget).
# Changing the decay needs `manage.py datasets_rebuild_difficulty`.
HEDGEROW_DIFFICULTY_ALPHA0 = env_float("HEDGEROW_DIFFICULTY_ALPHA0", 1.0)
HEDGEROW_DIFFICULTY_BETA0 = env_float("HEDGEROW_DIFFICULTY_BETA0", 1.0)
HEDGEROW_DIFFICULTY_DECAY = env_float("HEDGEROW_DIFFICULTY_DECAY", 0.5)
if not (HEDGEROW_DIFFICULTY_ALPHA0 > 0 and HEDGEROW_DIFFICULTY_BETA0 > 0):
    raise ImproperlyConfigured("HEDGEROW_DIFFICULTY_ALPHA0 and _BETA0 must be > 0")
if not 0 < HEDGEROW_DIFFICULTY_DECAY <= 1:
    raise ImproperlyConfigured("HEDGEROW_DIFFICULTY_DECAY must be in (0, 1]")

# Workers log through LOGGING above (JSON, with the request id carried into tasks);
# Celery must not replace the root handler with its own plain-text one.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
