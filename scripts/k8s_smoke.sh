#!/usr/bin/env bash
# `make k8s-smoke`: the public lifecycle against Hedgerow on a real cluster.
#   KUBECONFIG            the cluster (kubectl's current context otherwise)
#   HEDGEROW_NAMESPACE    the control plane's namespace (default hedgerow)
#   HEDGEROW_URL          the API; default: a kubectl port-forward to svc/hedgerow-web
#   HEDGEROW_API_KEY      a tenant key; default: a new key for tenant "k8s-smoke",
#                         created with `manage.py hedgerow_create_tenant` in the web pod
#   SMOKE_IMAGE           image to run (default "host" = HEDGEROW_K8S_DEFAULT_IMAGE)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NS="${HEDGEROW_NAMESPACE:-hedgerow}"
command -v kubectl >/dev/null || { echo "kubectl is required" >&2; exit 2; }
kubectl -n "$NS" get deploy/hedgerow-web >/dev/null || {
  echo "no hedgerow-web in namespace $NS (KUBECONFIG=${KUBECONFIG:-default})" >&2; exit 2; }

PF_PID=""
cleanup() { if [ -n "$PF_PID" ]; then kill "$PF_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT
if [ -z "${HEDGEROW_URL:-}" ]; then
  PORT="${SMOKE_LOCAL_PORT:-18080}"
  kubectl -n "$NS" port-forward svc/hedgerow-web "$PORT:80" >/dev/null 2>&1 &
  PF_PID=$!
  for _ in $(seq 1 50); do
    curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break; sleep 0.2
  done
  export HEDGEROW_URL="http://127.0.0.1:$PORT"
fi
if [ -z "${HEDGEROW_API_KEY:-}" ]; then
  HEDGEROW_API_KEY="$(kubectl -n "$NS" exec deploy/hedgerow-web -c web -- \
    python manage.py hedgerow_create_tenant k8s-smoke --key-name "smoke-$(date +%s)" --quiet \
    | tr -d '\r\n')"
  export HEDGEROW_API_KEY
fi
PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3
exec "$PY" "$ROOT/scripts/k8s_smoke.py"
