#!/usr/bin/env bash
# `make test`: starts what the suite needs (Postgres, Redis; the tests start their own
# Celery worker and web server against the test database), then runs static checks and
# the whole pytest suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# test-only system packages (browser, registry, userland builder): scripts/stack.sh
export HEDGEROW_TEST_TOOLS=1
scripts/stack.sh services
scripts/stack.sh install >/dev/null

# A unique instance per run: its own test database, Redis key prefix, Celery queue and
# backend resource names, so concurrent runs (and the dev stack) never collide.
RUN_ID="t$$"
export HEDGEROW_INSTANCE="${HEDGEROW_INSTANCE_OVERRIDE:-$RUN_ID}"
export HEDGEROW_TEST_DB_NAME="test_hedgerow_${HEDGEROW_INSTANCE}"
export HEDGEROW_DB_PORT="${HEDGEROW_DB_PORT:-55432}"
# Postgres and Redis passwords: settings read them from $HEDGEROW_STATE_DIR (stack.sh).
export HEDGEROW_REDIS_PORT="${HEDGEROW_REDIS_PORT:-56379}"
# The network tests' stand-in internets (apps/sandboxes/backends/tests/egress_internet.py,
# test_local_network.py) are private ranges: egress "all" refuses private ranges unless
# the operator lists them.
export HEDGEROW_EGRESS_PRIVATE_ALLOW="${HEDGEROW_EGRESS_PRIVATE_ALLOW-10.214.0.0/16,10.216.0.0/16}"

if [ -z "${HEDGEROW_SKIP_STATIC:-}" ]; then
  echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check . >/dev/null || {
    .venv/bin/ruff format --check . ; exit 1; }
  echo "== mypy --strict"; .venv/bin/mypy
  echo "== import-layer contract"; .venv/bin/lint-imports --no-cache >/dev/null || .venv/bin/lint-imports --no-cache
  echo "== makemigrations --check"; .venv/bin/python manage.py makemigrations --check --dry-run >/dev/null
  echo "== docker-compose config"; HEDGEROW_SECRET_KEY=validation-only HEDGEROW_DB_PASSWORD=validation-only \
    HEDGEROW_REDIS_PASSWORD=validation0only docker-compose -f docker-compose.yml config -q
  # offline: kustomize build only (apply --dry-run needs a cluster); the schema and
  # RBAC/policy checks run in apps/sandboxes/backends/kubernetes/tests/test_manifests.py
  echo "== kubectl kustomize"; for d in deploy/base deploy/overlays/*/; do
    .venv/bin/kubectl kustomize "$d" >/dev/null; done
fi
# Kernel state (bridges, nft tables, subnet claims) outlives killed runs; remove what
# provably dead runs left so the finite subnet pool never runs out.
.venv/bin/python -m apps.sandboxes.backends.local.gc || true
if [ $# -eq 0 ]; then
  # podagent's own tests once more against a zygote-started agent (a fork with the
  # late-import guard on): proves the zygote preloads every module the agent uses
  echo "== podagent tests, agent forked by the zygote"
  PODAGENT_TEST_LAUNCH=zygote .venv/bin/python -m pytest -q -p no:django podagent/tests
  # the Debian userland of the image tests (mmdebstrap, ~2.5 min): built here once per
  # machine (cached in /var/cache/hedgerow/userland), not inside a test's timeout
  if [ "$(id -u)" = 0 ]; then
    echo "== image test userland (cached per machine)"
    .venv/bin/python -m apps.sandboxes.backends.local.images.tests.swe
  fi
fi
echo "== pytest"
exec .venv/bin/python -m pytest "$@"
