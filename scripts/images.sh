#!/usr/bin/env bash
# Build the serving image and run the serving stack on this machine, without NGC images or an image registry
# (only Debian's mirrors and PyPI are reachable): see docs/images.md.
#
#   scripts/images.sh [MODEL_REPOSITORY]     default: $DSTOOL_MODEL_REPOSITORY, else a 20-step model trained
#                                            and exported here (needs .venv, scripts/setup.sh)
#
# 1. installs docker.io, debootstrap and docker-compose (apt) if missing
# 2. starts its own dockerd (overlay2, no bridge, no iptables) unless one answers on its socket; it is left
#    running (stop it: kill "$(cat $DSTOOL_IMAGES_DIR/dockerd.pid)")
# 3. makes the base image dstool-base:bookworm if missing: debootstrap minbase + this host's apt sources,
#    CA bundle and pip settings (how pip and apt reach their registries here)
# 4. builds dstool-serve:cpu (Dockerfile target serve on that base) and dstool-redis:bookworm
# 5. docker-compose -f docker-compose.cpu.yml up, waits for the gateway, sends a text request twice through the
#    gateway and checks the second one was a cache hit (its /metrics), then docker-compose down
#
# Exits nonzero with a one-line reason on any failure.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${DSTOOL_IMAGES_DIR:-/var/tmp/dstool-images}
SOCK=$WORK/docker.sock
export DOCKER_HOST=unix://$SOCK
# Debian's client matches its daemon (20.10) and builds with the daemon's own BuildKit (no buildx plugin needed)
DOCKER=/usr/bin/docker
export DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1
BASE=dstool-base:bookworm
SERVE=dstool-serve:cpu
REDIS=dstool-redis:bookworm
COMPOSE_FILE=$ROOT/docker-compose.cpu.yml
PROJECT=dstool-cpu
HTTP_PORT=18000 GRPC_PORT=18001 METRICS_PORT=18002 REDIS_PORT=6390   # as in docker-compose.cpu.yml
PROMPT="ROMEO:"
# seeded sampling: the same text every time (so cacheable), and visible text from a barely trained model,
# whose greedy continuation is newlines
INFER_ARGS=(--max-new-tokens 8 --temperature 0.8 --seed 1)

fail() { echo "images.sh: FAILED: $*" >&2; exit 1; }
step() { echo "== $*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
compose() { docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" "$@"; }

[ "$(id -u)" = 0 ] || fail "run as root (apt-get, dockerd, debootstrap)"
mkdir -p "$WORK" || fail "cannot create $WORK"
declare -A TIMES

# ---- 1. packages
missing=()
[ -x /usr/sbin/dockerd ] && [ -x "$DOCKER" ] || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-compose >/dev/null || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
    step "apt-get install ${missing[*]}"
    t=$(now)
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
        >"$WORK/apt.log" 2>&1 || fail "apt-get install ${missing[*]} failed (see $WORK/apt.log)"
    TIMES[apt]=$(since "$t")
fi

# ---- 2. dockerd
if ! "$DOCKER" info >/dev/null 2>&1; then
    step "starting dockerd on $SOCK (data: $WORK/data)"
    mkdir -p "$WORK/data" "$WORK/exec"
    setsid nohup /usr/sbin/dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" -H "unix://$SOCK" \
        --pidfile "$WORK/dockerd.pid" --iptables=false --ip6tables=false --bridge=none \
        >"$WORK/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.5; done
    "$DOCKER" info >/dev/null 2>&1 || fail "dockerd did not answer on $SOCK within 30 s (see $WORK/dockerd.log)"
fi
echo "dockerd: $("$DOCKER" version --format '{{.Server.Version}}') on $SOCK, storage $("$DOCKER" info --format '{{.Driver}}')"

# ---- 3. base image
if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
    step "making $BASE (debootstrap --variant=minbase bookworm)"
    t=$(now)
    rootfs=$WORK/rootfs
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
        || fail "debootstrap failed (see $WORK/debootstrap.log)"
    # apt: the host's sources (bookworm, -updates, -security) and its apt settings, not debootstrap's one line
    if ls /etc/apt/sources.list.d/*.sources >/dev/null 2>&1 || [ -s /etc/apt/sources.list ]; then
        rm -f "$rootfs/etc/apt/sources.list"
        cp /etc/apt/sources.list.d/*.sources "$rootfs/etc/apt/sources.list.d/" 2>/dev/null
        [ -s /etc/apt/sources.list ] && cp /etc/apt/sources.list "$rootfs/etc/apt/"
    fi
    for conf in /etc/apt/apt.conf.d/*; do   # proxies and a snapshot mirror's validity settings
        grep -qiE '^\s*Acquire::(https?::proxy|check-valid-until|check-date)' "$conf" 2>/dev/null \
            && cp "$conf" "$rootfs/etc/apt/apt.conf.d/"
    done
    # as Docker's debian images do: no package caches or translations left in the layers
    cat >"$rootfs/etc/apt/apt.conf.d/90dstool-image" <<'APT'
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
Acquire::GzipIndexes "true";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb || true"; };
APT
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
    # pip: the host's CA bundle (TLS to PyPI goes through an intercepting egress proxy here) and its index
    # settings that name a reachable registry (file:// indexes and find-links of the host are not in the image)
    bundle=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || echo /etc/ssl/certs/ca-certificates.crt)}
    [ -s "$bundle" ] || fail "no CA bundle at $bundle for pip"
    mkdir -p "$rootfs/usr/local/share/dstool"
    cp "$bundle" "$rootfs/usr/local/share/dstool/host-ca-bundle.crt"
    {
        echo "[global]"
        echo "cert = /usr/local/share/dstool/host-ca-bundle.crt"
        echo "timeout = ${PIP_DEFAULT_TIMEOUT:-180}"
        [ -n "${PIP_INDEX_URL:-}" ] && echo "index-url = $PIP_INDEX_URL"
    } >"$rootfs/etc/pip.conf"
    tar -C "$rootfs" -c . | "$DOCKER" import -c 'CMD ["/bin/bash"]' - "$BASE" >/dev/null \
        || fail "docker import of $BASE failed"
    rm -rf "$rootfs"
    TIMES[base]=$(since "$t")
fi

# ---- the model repository and the build context (sources + repository; the git tree is left as it is)
REPO=${1:-${DSTOOL_MODEL_REPOSITORY:-}}
if [ -z "$REPO" ]; then
    REPO=$WORK/model/repo
    if [ ! -f "$REPO/dstool.json" ]; then
        [ -x "$ROOT/.venv/bin/dstool" ] || fail "no model repository given and no .venv to make one (scripts/setup.sh)"
        step "training and exporting a small model into $REPO"
        t=$(now)
        rm -rf "$WORK/model"
        (cd "$ROOT" && .venv/bin/dstool train --nproc 1 --max-steps 20 --output "$WORK/model/train" \
            && .venv/bin/dstool export "$WORK/model/train/model" --repository "$REPO") >"$WORK/model.log" 2>&1 \
            || fail "dstool train/export failed (see $WORK/model.log)"
        TIMES[model]=$(since "$t")
    fi
fi
[ -d "$REPO" ] && [ -n "$(ls "$REPO")" ] || fail "model repository $REPO is missing or empty"
CONTEXT=$WORK/context
rm -rf "$CONTEXT" && mkdir -p "$CONTEXT" || fail "cannot create $CONTEXT"
(cd "$ROOT" && cp -a Dockerfile pyproject.toml README.md dstool train compress serve "$CONTEXT/") \
    || fail "cannot copy the sources into $CONTEXT"
find "$CONTEXT" -name __pycache__ -prune -exec rm -rf {} +
cp -a "$REPO" "$CONTEXT/model_repository" || fail "cannot copy $REPO into $CONTEXT"
export DSTOOL_BUILD_CONTEXT=$CONTEXT
echo "build context: $CONTEXT ($(du -sh "$CONTEXT" | cut -f1), model repository from $REPO)"

# ---- 4. images
step "building $SERVE (target serve, TRITON_IMAGE=$BASE, TRITONSERVER=)"
t=$(now)
"$DOCKER" build --network host --target serve --build-arg TRITON_IMAGE="$BASE" --build-arg TRITONSERVER= \
    -t "$SERVE" "$CONTEXT" >"$WORK/build-serve.log" 2>&1 || fail "building $SERVE failed (see $WORK/build-serve.log)"
TIMES[serve]=$(since "$t")
step "building $REDIS (redis-server from Debian)"
t=$(now)
"$DOCKER" build --network host -t "$REDIS" - >"$WORK/build-redis.log" 2>&1 <<EOF || fail "building $REDIS failed (see $WORK/build-redis.log)"
FROM $BASE
RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*
CMD ["redis-server", "--bind", "127.0.0.1", "--port", "6379", "--save", ""]
EOF
TIMES[redis]=$(since "$t")

# ---- 5. the stack
for port in $HTTP_PORT $GRPC_PORT $METRICS_PORT $REDIS_PORT; do
    ss -Hltn "sport = :$port" | grep -q . && fail "port $port is in use (ss -ltnp 'sport = :$port')"
done
trap 'compose down --timeout 30 >/dev/null 2>&1' EXIT
step "docker-compose -f docker-compose.cpu.yml up -d"
t=$(now)
compose up -d --no-build >"$WORK/compose-up.log" 2>&1 || fail "docker-compose up failed (see $WORK/compose-up.log)"
cid=$(compose ps -q serve) && [ -n "$cid" ] || fail "docker-compose started no serve container"
ready=
for _ in $(seq 240); do
    if curl -fsS -o /dev/null "http://127.0.0.1:$HTTP_PORT/v2/health/ready" 2>/dev/null; then ready=1; break; fi
    [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$cid" 2>/dev/null)" = true ] \
        || { compose logs --tail 20 serve >&2; fail "the serve container stopped before it was ready"; }
    sleep 0.5
done
[ -n "$ready" ] || { compose logs --tail 20 serve >&2; fail "the gateway was not ready after 120 s"; }
TIMES[ready]=$(since "$t")
echo "gateway ready on 127.0.0.1:$HTTP_PORT after ${TIMES[ready]} s"

hits() {
    curl -fsS "http://127.0.0.1:$HTTP_PORT/metrics" | awk '/^dstool_gateway_cache_hits_total/ { s += $NF } END { print s + 0 }'
}
infer() {
    if [ -x "$ROOT/.venv/bin/dstool" ]; then
        "$ROOT/.venv/bin/dstool" infer "$PROMPT" --url "127.0.0.1:$HTTP_PORT" "${INFER_ARGS[@]}"
    else  # no host venv: the image's own client, through the same gateway port
        compose exec -T serve dstool infer "$PROMPT" --url "127.0.0.1:$HTTP_PORT" "${INFER_ARGS[@]}"
    fi
}
before=$(hits) || fail "the gateway's /metrics did not answer"
for n in 1 2; do
    t=$(now)
    out=$(infer 2>&1) || fail "dstool infer through the gateway failed: $(echo "$out" | tail -1)"
    echo "request $n (dstool infer '$PROMPT' ${INFER_ARGS[*]}) in $(since "$t") s: ${out//$'\n'/\\n}"
    [ "$n" = 1 ] && first=$out
done
[ "$out" = "$first" ] || fail "the second answer differs from the first"
after=$(hits)
echo "dstool_gateway_cache_hits_total: $before -> $after"
[ "$after" -gt "$before" ] || fail "the gateway reported no cache hit for the repeated request"
keys=$(compose exec -T redis redis-cli -p "$REDIS_PORT" dbsize | tr -d '\r')
echo "redis keys (dbsize): $keys"
[ "${keys:-0}" -gt 0 ] || fail "the gateway stored nothing in Redis"

step "docker-compose down"
compose down --timeout 30 >"$WORK/compose-down.log" 2>&1 || fail "docker-compose down failed (see $WORK/compose-down.log)"
trap - EXIT

step "images"
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^($BASE|$SERVE|$REDIS) " | sort
step "times (s)"
for k in apt base model serve redis ready; do [ -n "${TIMES[$k]:-}" ] && echo "$k: ${TIMES[$k]}"; done
echo "dockerd left running on $SOCK (pid $(cat "$WORK/dockerd.pid" 2>/dev/null || echo '?'))"
echo "images.sh: OK"
