#!/usr/bin/env bash
# Brings the Hedgerow stack up and down on one machine, under .state/ (git-ignored),
# on its own ports, never touching system services. Used by `make up/down/test`.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STATE="${HEDGEROW_STATE_DIR:-$ROOT/.state}"
RUN="$STATE/run"
LOGS="$STATE/logs"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
PG_PORT="${HEDGEROW_DB_PORT:-55432}"
REDIS_PORT="${HEDGEROW_REDIS_PORT:-56379}"
WEB_PORT="${HEDGEROW_WEB_PORT:-8000}"
PG_BIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)"
# runtime packages (make up); make test adds TEST_APT_PACKAGES (install_system)
APT_PACKAGES="postgresql redis-server bubblewrap libseccomp2 util-linux btrfs-progs nftables iptables iproute2 procps psmisc nodejs npm skopeo"
TEST_APT_PACKAGES="chromium docker-compose busybox-static docker-registry apache2-utils mmdebstrap"

# Redis's memory bound (docs/operations.md says how to size it). Only keys with a TTL
# may be evicted: Celery's queues and bindings have none, every replay buffer has one.
REDIS_MAXMEMORY="${HEDGEROW_REDIS_MAXMEMORY:-512mb}"
REDIS_POLICY="volatile-lru"

export HEDGEROW_DB_PORT="$PG_PORT"
# The app reads the passwords from $STATE (controlplane/env.py): no URL with a
# password is exported from here. HEDGEROW_REDIS_URL, when set, is used verbatim.
export HEDGEROW_REDIS_PORT="$REDIS_PORT"
export HEDGEROW_STATE_DIR="$STATE"

log() { printf '\033[1m[hedgerow]\033[0m %s\n' "$*"; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_system() {
  local missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  [ -n "$PG_BIN" ] || missing+=(postgresql)
  command -v bwrap >/dev/null || missing+=(bubblewrap)
  command -v mkfs.btrfs >/dev/null || missing+=(btrfs-progs)  # sandbox storage (quotas)
  # the sandbox's seccomp filter (podagent/seccomp.py) and user namespaces (nsenter)
  dpkg -s libseccomp2 >/dev/null 2>&1 || missing+=(libseccomp2)
  command -v nsenter >/dev/null || missing+=(util-linux)
  command -v nft >/dev/null || missing+=(nftables)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v pkill >/dev/null || missing+=(procps)
  command -v npm >/dev/null || missing+=(nodejs npm)
  # OCI images (docs/images.md): skopeo pulls them for sandboxes
  command -v skopeo >/dev/null || missing+=(skopeo)
  # What only `make test` needs (scripts/test.sh sets HEDGEROW_TEST_TOOLS=1), so that
  # `make up` on a fresh machine does not wait for a browser and a registry it never runs.
  if [ -n "${HEDGEROW_TEST_TOOLS:-}" ]; then
    command -v chromium >/dev/null || missing+=(chromium)  # dashboard browser tests
    command -v docker-compose >/dev/null || missing+=(docker-compose)  # compose config check
    # images without python3 (the agent-bundle and zygote tests build one from busybox)
    command -v busybox >/dev/null || missing+=(busybox-static)
    # the image tests run Debian's reference registry on loopback with htpasswd (bcrypt)
    # auth, and build a real distribution userland once per machine
    command -v docker-registry >/dev/null || missing+=(docker-registry)
    command -v htpasswd >/dev/null || missing+=(apache2-utils)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing system packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    # the docker-registry package enables a machine-wide registry on :5000; the tests
    # only run their own on loopback, so one we just installed is stopped again
    if [[ " ${missing[*]} " == *" docker-registry "* ]] && command -v systemctl >/dev/null; then
      as_root systemctl disable --now docker-registry >/dev/null 2>&1 || true
    fi
    PG_BIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
  fi
}

install_python() {
  # A worktree whose .venv links to another checkout's venv does not manage it: that
  # checkout does. Installing from here would repoint the shared editable SDK at this
  # tree and reinstall packages under the other trees' running tests.
  if [ -L "$VENV" ]; then
    return 0
  fi
  if [ ! -x "$PY" ]; then
    log "creating virtualenv"
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.requirements-stamp"
  local want
  want="$( (cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$ROOT/sdk/pyproject.toml" 2>/dev/null || true) | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing Python packages"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
    if [ -f "$ROOT/sdk/pyproject.toml" ]; then
      "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT/sdk"
    fi
    echo "$want" > "$stamp"
  fi
}

build_frontend() {
  if [ -f "$ROOT/frontend/package.json" ]; then
    local stamp="$ROOT/frontend/node_modules/.hedgerow-stamp"
    local want
    want="$( (cat "$ROOT/frontend/package-lock.json" 2>/dev/null || true) | sha256sum | cut -c1-16)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
      log "installing frontend packages"
      (cd "$ROOT/frontend" && npm ci --no-audit --no-fund --loglevel=error)
      echo "$want" > "$stamp"
    fi
    log "building frontend assets"
    (cd "$ROOT/frontend" && npm run --silent build >/dev/null)
  fi
}

state_secret() {  # file: one random credential per installation (0600, git-ignored)
  mkdir -p "$STATE"
  if [ ! -s "$1" ]; then
    # hex: safe unquoted in a URL, a libpq conninfo and SQL
    (umask 077 && od -An -tx1 -N24 /dev/urandom | tr -d ' \n' >"$1")
  fi
}

pg_hba_secure() {  # data dir: password (SCRAM) for every connection, loopback only
  cat >"$1/pg_hba.conf" <<'HBA'
# Written by scripts/stack.sh: every connection needs the password in .state/db_password.
local   all   all                  scram-sha-256
host    all   all   127.0.0.1/32   scram-sha-256
host    all   all   ::1/128        scram-sha-256
HBA
  chown postgres:postgres "$1/pg_hba.conf"
  chmod 0600 "$1/pg_hba.conf"
}

pg_up() {
  mkdir -p "$STATE" "$RUN" "$LOGS"
  local data="$STATE/postgres" pwfile="$STATE/db_password"
  state_secret "$pwfile"
  if [ ! -s "$data/PG_VERSION" ]; then
    log "creating a private Postgres cluster in $data"
    mkdir -p "$data"
    chown -R postgres:postgres "$data"
    # initdb runs as postgres and cannot read our 0600 file: a private copy for it.
    local tmp; tmp="$(mktemp -d)"
    install -m 0600 -o postgres "$pwfile" "$tmp/pw"
    chown postgres "$tmp"
    runuser -u postgres -- "$PG_BIN/initdb" -A scram-sha-256 --pwfile="$tmp/pw" \
      -U hedgerow -D "$data" >/dev/null
    rm -rf "$tmp"
    pg_hba_secure "$data"
  fi
  chown postgres:postgres "$data"
  if ! runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    # Crash-safe by default: fsync and full-page writes on (a power cut cannot corrupt
    # the cluster); commits are asynchronous (an OS crash may lose the last ~0.6 s of
    # commits, never consistency). HEDGEROW_PG_UNSAFE_FAST=1 turns fsync and full-page
    # writes off for a throwaway cluster (a scratch CI machine), never for real data.
    local durability="-c synchronous_commit=off"
    if [ "${HEDGEROW_PG_UNSAFE_FAST:-0}" = 1 ]; then
      durability="$durability -c fsync=off -c full_page_writes=off"
    fi
    log "starting Postgres on 127.0.0.1:$PG_PORT"
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$data" -w -l "$data/server.log" \
      -o "-p $PG_PORT -k /tmp -c listen_addresses=127.0.0.1 -c max_connections=400 $durability" start >/dev/null
  fi
  pg_upgrade_auth "$data" "$pwfile"
  PGPASSWORD="$(cat "$pwfile")" "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U hedgerow -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname='hedgerow'" | grep -q 1 || \
    PGPASSWORD="$(cat "$pwfile")" "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U hedgerow hedgerow
}

pg_upgrade_auth() {  # data dir, password file
  # A cluster made before credentials (initdb -A trust: any local user was superuser)
  # is upgraded in place, idempotently: set the password over the still-trusted
  # connection, then require it everywhere and reload. Nothing to do once no rule trusts.
  grep -Eq '^[[:space:]]*[^#[:space:]].*[[:space:]]trust([[:space:]]|$)' "$1/pg_hba.conf" || return 0
  log "requiring a password for Postgres (was trust authentication)"
  # The statement goes through stdin: a password never appears in a process list.
  printf "ALTER ROLE hedgerow WITH PASSWORD '%s';\n" "$(cat "$2")" | \
    "$PG_BIN/psql" -X -q -h 127.0.0.1 -p "$PG_PORT" -U hedgerow -d postgres -v ON_ERROR_STOP=1 -f - >/dev/null
  pg_hba_secure "$1"
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$1" reload >/dev/null
  # reload is asynchronous: wait until a password-less connection is refused
  for _ in $(seq 50); do
    PGPASSFILE=/nonexistent "$PG_BIN/psql" -X -w -h 127.0.0.1 -p "$PG_PORT" -U hedgerow -d postgres \
      -tAc 'SELECT 1' >/dev/null 2>&1 || return 0
    sleep 0.1
  done
  echo "Postgres still accepts connections without a password" >&2; exit 1
}

redis_conf() {  # the config file (0600: it holds the password)
  (umask 077 && cat >"$STATE/redis/redis.conf" <<CONF
# Written by scripts/stack.sh (make up / make test).
port $REDIS_PORT
bind 127.0.0.1
protected-mode yes
requirepass $(cat "$STATE/redis_password")
maxmemory $REDIS_MAXMEMORY
maxmemory-policy $REDIS_POLICY
save ""
appendonly no
daemonize yes
dir $STATE/redis
pidfile $RUN/redis.pid
logfile $STATE/redis/redis.log
CONF
)
}

redis_up() {
  mkdir -p "$STATE/redis" "$RUN"
  state_secret "$STATE/redis_password"
  redis_conf
  # redis-cli reads the password from REDISCLI_AUTH, never from its command line.
  local auth; auth="$(cat "$STATE/redis_password")"
  if redis-cli -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then
    # started before credentials: require the password from now on (in place, so
    # nothing queued is lost; open connections stay authenticated)
    log "requiring a password for Redis (it had none)"
    printf 'CONFIG SET requirepass %s\n' "$auth" | redis-cli -p "$REDIS_PORT" | grep -q OK
  elif REDISCLI_AUTH="$auth" redis-cli --no-auth-warning -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then
    :  # ours, with its password: the bound and policy below are (re)applied
  else
    log "starting Redis on 127.0.0.1:$REDIS_PORT"
    redis-server "$STATE/redis/redis.conf"
    for _ in $(seq 50); do
      REDISCLI_AUTH="$auth" redis-cli --no-auth-warning -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG && break
      sleep 0.1
    done
  fi
  local name value
  for name in maxmemory maxmemory-policy; do
    value="$REDIS_MAXMEMORY"; [ "$name" = maxmemory-policy ] && value="$REDIS_POLICY"
    REDISCLI_AUTH="$auth" redis-cli --no-auth-warning -p "$REDIS_PORT" CONFIG SET "$name" "$value" | grep -q OK || {
      echo "Redis did not start (or refused CONFIG SET $name; see $STATE/redis/redis.log)" >&2; exit 1; }
  done
}

secret_key() {
  # One random key per installation, kept with its state (mode 0600, git-ignored).
  mkdir -p "$STATE"
  if [ ! -s "$STATE/secret_key" ]; then
    (umask 077 && head -c 48 /dev/urandom | base64 | tr -d '\n/+=' >"$STATE/secret_key")
  fi
  # Fernet key for registry passwords at rest (apps/images/crypto.py): 32 random bytes,
  # url-safe base64. Never in the database, so a dump alone decrypts nothing.
  if [ ! -s "$STATE/credentials_key" ]; then
    (umask 077 && head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '\n' >"$STATE/credentials_key")
  fi
}

# The default ports (55432, 56379) lie in Linux's ephemeral range (32768-60999): on a busy
# machine an outgoing connection can hold one when Postgres or Redis starts, which then
# fails with "Address already in use". As root, reserve our listening ports so the kernel
# never hands them out as source ports (a machine-wide list; ours are added, none removed).
reserve_ports() {
  local file=/proc/sys/net/ipv4/ip_local_reserved_ports current port
  [ "$(id -u)" = 0 ] && [ -w "$file" ] || return 0
  current="$(cat "$file")"
  for port in "$@"; do
    case ",$current," in *",$port,"*) continue ;; esac
    current="${current:+$current,}$port"
  done
  echo "$current" >"$file" 2>/dev/null || true
}

services_up() { install_system; install_python; secret_key; reserve_ports "$PG_PORT" "$REDIS_PORT" "$WEB_PORT"; pg_up; redis_up; }

start_bg() {  # name, command...
  local name="$1"; shift
  local pidfile="$RUN/$name.pid"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then return 0; fi
  # `setsid cmd &` from a non-interactive shell execs cmd as a session leader, so $! is
  # the program itself and `make down` can signal its whole process group. No file
  # descriptor of ours is inherited (a pipe held open would hang `make up | tail`).
  cd "$ROOT"
  setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
  echo $! >"$pidfile"
}

# The configuration `make up` starts with (scripts/stack-defaults.env, which bench/ runs
# against too): web workers and their DB pools, the Celery worker's processes, the
# subnet's size (a /21 holds 2045 sandboxes on four bridges; tests keep the /24 default
# so that many runs share the subnet pool). A variable already set in the environment
# wins. `scripts/stack.sh config` prints it.
stack_config() {
  local key value
  while IFS='=' read -r key value; do
    [[ "$key" =~ ^HEDGEROW_[A-Z0-9_]+$ ]] || continue
    [ -n "${!key+x}" ] || export "$key=$value"
  done < "$ROOT/scripts/stack-defaults.env"
}

print_config() {
  stack_config
  local key
  for key in $(grep -oE '^HEDGEROW_[A-Z0-9_]+' "$ROOT/scripts/stack-defaults.env"); do
    echo "$key=${!key}"
  done
}

app_up() {
  mkdir -p "$LOGS" "$RUN"
  # The demo's local registry (docs/images.md "A user's guide": docker-registry on
  # 127.0.0.1:5050, plain HTTP) is listed as an operator lists one: the registry egress
  # policy refuses loopback registries otherwise (docs/security.md "Registry egress").
  # Set HEDGEROW_INSECURE_REGISTRIES (even empty) to choose otherwise.
  export HEDGEROW_INSECURE_REGISTRIES="${HEDGEROW_INSECURE_REGISTRIES-127.0.0.1:5050}"
  stack_config
  "$PY" "$ROOT/manage.py" migrate --noinput >/dev/null
  "$PY" "$ROOT/manage.py" collectstatic --noinput >/dev/null
  start_bg web env HEDGEROW_DB_POOL="${HEDGEROW_DB_POOL:-1}" \
    "$PY" -m controlplane.serve controlplane.asgi:application --host 0.0.0.0 --port "$WEB_PORT" \
    --workers "$HEDGEROW_WEB_WORKERS" --no-access-log \
    --loop uvloop --http httptools
  start_bg worker "$VENV/bin/celery" -A controlplane worker -l info -c "$HEDGEROW_WORKER_CONCURRENCY" \
    -Q "${HEDGEROW_INSTANCE:-dev}.cold" -n "worker-${HEDGEROW_INSTANCE:-dev}@%h"
  start_bg beat "$VENV/bin/celery" -A controlplane beat -l info -s "$STATE/celerybeat-schedule"
  start_bg watcher "$PY" "$ROOT/manage.py" hedgerow_watch
  for _ in $(seq 100); do
    curl -fsS "http://127.0.0.1:$WEB_PORT/healthz" >/dev/null 2>&1 && return 0; sleep 0.2
  done
  echo "the web process did not start; see $LOGS/web.log" >&2; exit 1
}

demo() {
  local envfile="$STATE/demo.env"
  local key=""
  if [ -f "$envfile" ]; then
    # shellcheck disable=SC1090
    key="$(. "$envfile"; echo "${HEDGEROW_API_KEY:-}")"
    if [ -n "$key" ] && ! curl -fsS -o /dev/null -H "Authorization: Bearer $key" \
        "http://127.0.0.1:$WEB_PORT/api/v1/sandboxes?limit=1"; then key=""; fi
  fi
  if [ -z "$key" ]; then
    key="$("$PY" "$ROOT/manage.py" hedgerow_create_tenant demo --name "Demo team" \
      --key-name "make up" --owner demo --owner-password demo --quiet)"
    umask 077
    printf 'HEDGEROW_URL=http://127.0.0.1:%s\nHEDGEROW_API_KEY=%s\n' "$WEB_PORT" "$key" >"$envfile"
  fi
  cat <<MSG

Hedgerow is up.
  Dashboard:  http://127.0.0.1:$WEB_PORT/   (sign in as demo / demo)
  API docs:   http://127.0.0.1:$WEB_PORT/api/docs/
  Demo key:   $key      (also in $envfile)

Try it:
  export HEDGEROW_URL=http://127.0.0.1:$WEB_PORT HEDGEROW_API_KEY=$key
  SB=\$(curl -s -H "Authorization: Bearer \$HEDGEROW_API_KEY" -H 'Content-Type: application/json' \\
        -d '{"image":"host"}' \$HEDGEROW_URL/api/v1/sandboxes | python3 -c 'import json,sys;print(json.load(sys.stdin)["id"])')
  curl -s -H "Authorization: Bearer \$HEDGEROW_API_KEY" "\$HEDGEROW_URL/api/v1/sandboxes/\$SB/wait?timeout=60"
  curl -s -H "Authorization: Bearer \$HEDGEROW_API_KEY" -H 'Content-Type: application/json' \\
       -d '{"command":"echo hello"}' \$HEDGEROW_URL/api/v1/sandboxes/\$SB/exec
  echo 'some bytes' | curl -s -H "Authorization: Bearer \$HEDGEROW_API_KEY" -T - \\
       "\$HEDGEROW_URL/api/v1/sandboxes/\$SB/files?path=/workspace/hello.txt"
  curl -s -H "Authorization: Bearer \$HEDGEROW_API_KEY" "\$HEDGEROW_URL/api/v1/sandboxes/\$SB/files?path=/workspace/hello.txt"
  curl -s -X DELETE -H "Authorization: Bearer \$HEDGEROW_API_KEY" \$HEDGEROW_URL/api/v1/sandboxes/\$SB

Stop everything with: make down
MSG
}

app_down() {
  for name in watcher beat worker web; do
    local pidfile="$RUN/$name.pid"
    if [ -f "$pidfile" ]; then
      local pid; pid="$(cat "$pidfile")"
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      rm -f "$pidfile"
    fi
  done
}

services_down() {
  if [ -f "$RUN/redis.pid" ]; then kill "$(cat "$RUN/redis.pid")" 2>/dev/null || true; rm -f "$RUN/redis.pid"; fi
  if [ -n "$PG_BIN" ] && [ -s "$STATE/postgres/PG_VERSION" ]; then
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$STATE/postgres" -m fast stop >/dev/null 2>&1 || true
  fi
}

sandboxes_down() {
  # Sandboxes run detached from the worker by design; `make down` removes them too.
  "$PY" "$ROOT/manage.py" hedgerow_backend_cleanup >/dev/null 2>&1 || true
}

case "${1:-}" in
  services) services_up ;;
  up) services_up; build_frontend; app_up; demo ;;
  down) sandboxes_down; app_down; services_down; log "stopped" ;;
  app-down) app_down ;;
  install) install_system; install_python; build_frontend ;;
  config) print_config ;;
  *) echo "usage: $0 services|up|down|app-down|install|config" >&2; exit 2 ;;
esac
