#!/usr/bin/env bash
# Assembles the self-contained pod-agent bundle: a Python interpreter with its stdlib,
# the shared libraries it and its extension modules link against, the dynamic loader,
# the `podagent` package and the launcher. The result runs on any Linux root
# filesystem of the same architecture (busybox, distroless, Alpine/musl, an old glibc),
# because nothing is taken from the image: the bundled loader is invoked directly with
# --library-path, and the interpreter runs isolated (-I), so neither PYTHONHOME nor
# LD_LIBRARY_PATH is ever set and the image's own environment reaches commands intact.
#
# usage: scripts/build_agent_bundle.sh [--python /usr/bin/python3] [--no-compile] OUT_DIR
#
# Layout of OUT_DIR (mounted at /opt/hedgerow/bundle in sandboxes and pods):
#   bin/python3                 the interpreter (getpath finds lib/ from here)
#   lib/ld.so                   the dynamic loader, under a fixed name
#   lib/*.so*                   libc, libm, libz, libssl, … (resolved with ldd)
#   lib/pythonX.Y/              stdlib + lib-dynload + podagent + hedgerow_launcher
#   run-agent                   `sh` convenience wrapper (only where the image has a sh)
#   manifest.json               versions and the exact argv to start the agent
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON=/usr/bin/python3
COMPILE=1
while [ $# -gt 1 ]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --no-compile) COMPILE=0; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -eq 1 ] || { echo "usage: $0 [--python PY] [--no-compile] OUT_DIR" >&2; exit 2; }
OUT="$1"
PY="$(readlink -f "$(command -v "$PYTHON")")"

read -r VER STDLIB DYNLOAD < <("$PY" -c '
import sys, sysconfig
print("%d.%d" % sys.version_info[:2], sysconfig.get_path("stdlib"),
      sysconfig.get_config_var("DESTSHARED") or sysconfig.get_path("stdlib") + "/lib-dynload")')

STAGE="$(mktemp -d "${OUT%/}.build.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
LIBPY="$STAGE/lib/python$VER"
mkdir -p "$STAGE/bin" "$LIBPY"

cp -L "$PY" "$STAGE/bin/python3"
# The stdlib minus what an agent never imports (tests, GUI, installers, third-party
# site/dist-packages) keeps the bundle near 20 MB: it is copied into every pod.
tar -C "$STDLIB" -cf - \
  --exclude='./test' --exclude='./*/test' --exclude='./*/tests' --exclude='./idlelib' \
  --exclude='./tkinter' --exclude='./turtledemo' --exclude='./ensurepip' \
  --exclude='./lib2to3' --exclude='./site-packages' --exclude='./dist-packages' \
  --exclude='./lib-dynload' --exclude='__pycache__' --exclude='./config-*' . \
  | tar -C "$LIBPY" -xf -
mkdir -p "$LIBPY/lib-dynload"
cp -L "$DYNLOAD"/*.so "$LIBPY/lib-dynload/" 2>/dev/null || true
rm -f "$LIBPY"/lib-dynload/_tkinter*.so "$LIBPY"/lib-dynload/_test*.so \
  "$LIBPY"/lib-dynload/xxlimited*.so

# Shared libraries: everything ldd resolves for the interpreter and its extensions.
LOADER=""
for f in "$STAGE/bin/python3" "$LIBPY"/lib-dynload/*.so; do
  while read -r line; do
    case "$line" in
      *"=> not found"*) echo "warning: $f: $line" >&2 ;;
      *"=> /"*) lib="${line#*=> }"; lib="${lib%% (*}"; cp -Ln "$lib" "$STAGE/lib/" ;;
      /*ld-linux*|/*ld-musl*|/*ld.so*) LOADER="${line%% (*}" ;;
    esac
  done < <(ldd "$f" 2>/dev/null || true)
done
[ -n "$LOADER" ] || { echo "no dynamic loader found for $PY (static interpreter?)" >&2; exit 1; }
cp -L "$LOADER" "$STAGE/lib/ld.so"

# The agent and its launcher live in the stdlib directory: it is on sys.path even in
# isolated mode and whatever the distribution's site.py does with site-packages.
tar -C "$ROOT" -cf - --exclude='__pycache__' --exclude='podagent/tests' podagent \
  | tar -C "$LIBPY" -xf -
cp "$ROOT/bundle/hedgerow_launcher.py" "$LIBPY/hedgerow_launcher.py"

run_bundled() { env -i "$STAGE/lib/ld.so" --library-path "$STAGE/lib" "$STAGE/bin/python3" -I "$@"; }
if [ "$COMPILE" = 1 ]; then
  # Pods mount the bundle read-only: without .pyc files every start recompiles.
  run_bundled -m compileall -q -j 0 "$LIBPY" >/dev/null
fi
# Prove the bundle is self-contained before anything ships it.
run_bundled -c 'import podagent.server, hedgerow_launcher, json, ssl, hashlib, pty, zlib'

AGENT_SHA="$(cd "$ROOT" && find podagent -name '*.py' -not -path '*/tests/*' | sort \
  | xargs sha256sum | sha256sum | cut -d' ' -f1)"
"$PY" - "$STAGE" "$VER" "$AGENT_SHA" "$(uname -m)" <<'PYEOF'
import json, sys
stage, ver, sha, arch = sys.argv[1:]
launch = ["lib/ld.so", "--library-path", "lib", "bin/python3", "-I", "-m", "hedgerow_launcher"]
json.dump({"format": 1, "python": ver, "arch": arch, "podagent_sha256": sha,
           "launch": launch}, open(f"{stage}/manifest.json", "w"), indent=1)
PYEOF
cat >"$STAGE/run-agent" <<'SH'
#!/bin/sh
# Starts the launcher from wherever the bundle is; images without sh use manifest.json's argv.
d=$(cd "$(dirname "$0")" && pwd)
exec "$d/lib/ld.so" --library-path "$d/lib" "$d/bin/python3" -I -m hedgerow_launcher "$@"
SH
chmod 0755 "$STAGE/run-agent"
chmod -R a+rX "$STAGE"

rm -rf "$OUT"
mv "$STAGE" "$OUT"
trap - EXIT
echo "bundle: $OUT ($(du -sh "$OUT" | cut -f1), python $VER, $(uname -m))"
