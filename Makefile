.PHONY: up down test screenshots lint typecheck check-migrations compose-config services bench k8s-smoke k8s-manifests agent-bundle

up:
	@scripts/stack.sh up

down:
	@scripts/stack.sh down

services:
	@scripts/stack.sh services

test:
	@scripts/test.sh

# Refreshes docs/screenshots/*.png (the README's) from the browser tests that take them;
# `make test` writes its screenshots to a scratch directory and leaves the tree clean.
SCREENSHOT_TESTS = frontend/tests/test_screens_live.py frontend/tests/test_images_live.py \
	apps/billing/tests/test_pages_browser.py apps/sandboxes/tests/test_audit_pages_live.py \
	apps/trajectories/tests/test_pages_live.py
screenshots:
	@HEDGEROW_UPDATE_SCREENSHOTS=1 HEDGEROW_SKIP_STATIC=1 scripts/test.sh $(SCREENSHOT_TESTS) -q

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
	kubectl kustomize deploy/overlays/example >/dev/null

agent-bundle:
	scripts/build_agent_bundle.sh .state/agent-bundle
