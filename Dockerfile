# syntax=docker/dockerfile:1
# One image for the control plane: web, worker, beat and watcher differ only in their
# command (docker-compose.yml, deploy/). Runs as an unprivileged user by default (the
# Kubernetes backend needs nothing more); the local backend needs root, network
# namespaces and bubblewrap, so compose runs those services as root, privileged.

# --- dashboard assets (TypeScript → static/dist); node stays out of the final image
FROM node:20-bookworm-slim AS frontend
WORKDIR /src/frontend
COPY frontend/package.json frontend/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY frontend/ ./
RUN npm run build

# --- the self-contained agent bundle, for local-backend images without Python
FROM python:3.11-slim-bookworm AS bundle
WORKDIR /src
COPY scripts/build_agent_bundle.sh scripts/
COPY bundle/ bundle/
COPY podagent/ podagent/
COPY zygote/ zygote/
RUN scripts/build_agent_bundle.sh --python /usr/local/bin/python3 /opt/hedgerow/agent-bundle

# --- the control plane
FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=controlplane.settings \
    HEDGEROW_STATE_DIR=/var/lib/hedgerow \
    HEDGEROW_AGENT_BUNDLE=/opt/hedgerow/agent-bundle
# bubblewrap/nftables/iproute2/procps/btrfs-progs (+ mount: util-linux): the local
# backend, btrfs-progs formats its sandbox storage. python3 (Debian's, at
# /usr/bin/python3 = HEDGEROW_AGENT_PYTHON) runs the agent in `host`-image sandboxes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       bubblewrap nftables iproute2 procps btrfs-progs python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 hedgerow \
    && useradd --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin hedgerow
WORKDIR /app
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
COPY --from=frontend /src/frontend/static/dist frontend/static/dist
COPY --from=bundle /opt/hedgerow/agent-bundle /opt/hedgerow/agent-bundle
RUN pip install --no-cache-dir ./sdk \
    && python manage.py collectstatic --noinput \
    && mkdir -p /var/lib/hedgerow && chown hedgerow:hedgerow /var/lib/hedgerow
USER 10001:10001
EXPOSE 8000
# No access log: the Orchard PTY URL carries its api_key (the one documented exception).
CMD ["python", "-m", "controlplane.serve", "controlplane.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--no-access-log", "--loop", "uvloop", "--http", "httptools"]
