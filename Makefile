.PHONY: up down test screenshots lint typecheck check-migrations compose-config services bench k8s-smoke k8s-manifests helm-chart agent-bundle

up:
	@scripts/stack.sh up

down:
	@scripts/stack.sh down

services:
	@scripts/stack.sh services

test:
	@scripts/test.sh

# Refreshes docs/screenshots/ on purpose (make test writes them to a scratch dir)
screenshots:
	@HEDGEROW_UPDATE_SCREENSHOTS=1 HEDGEROW_SKIP_STATIC=1 scripts/test.sh $$(grep -rl "screenshot(" frontend/tests apps/*/tests --include="test_*.py")

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports --no-cache

typecheck:
	.venv/bin/mypy

check-migrations:
	.venv/bin/python manage.py makemigrations --check --dry-run

compose-config:
	HEDGEROW_SECRET_KEY=validation-only HEDGEROW_DB_PASSWORD=validation-only HEDGEROW_REDIS_PASSWORD=validation0only docker-compose -f docker-compose.yml config -q

bench:
	.venv/bin/python bench/exec_latency.py

# The public lifecycle against Hedgerow on a real cluster (KUBECONFIG); docs/deploy-kubernetes.md
k8s-smoke:
	@scripts/k8s_smoke.sh

k8s-manifests:
	.venv/bin/kubectl kustomize deploy/overlays/example >/dev/null

# Regenerates deploy/helm/hedgerow from the kustomize overlay (test_helm.py checks it)
helm-chart:
	.venv/bin/python scripts/build_helm_chart.py

agent-bundle:
	scripts/build_agent_bundle.sh .state/agent-bundle
