#!/usr/bin/env bash
# Build the serving image and run the serving stack on this machine, without NGC images or an image registry
# (only Debian's mirrors and PyPI are reachable): see docs/images.md.
#
#   scripts/images.sh [--cluster] [MODEL_REPOSITORY]
#                     MODEL_REPOSITORY default: $DSTOOL_MODEL_REPOSITORY, else a 20-step model trained and
#                     exported here (needs .venv, scripts/setup.sh)
#                     --cluster (or DSTOOL_IMAGES_CLUSTER=1): step 5 runs the compose profile "cluster" instead
#
# 1. installs docker.io, debootstrap and docker-compose (apt) if missing
# 2. starts its own dockerd (overlay2, no bridge, no iptables) unless one answers on its socket; it is left
#    running (stop it: kill "$(cat $DSTOOL_IMAGES_DIR/dockerd.pid)")
# 3. makes the base image dstool-base:bookworm if missing: debootstrap minbase + this host's apt sources,
#    CA bundle and pip settings (how pip and apt reach their registries here)
# 4. builds dstool-serve:cpu (Dockerfile target serve on that base) and dstool-redis:bookworm
# 5. docker-compose -f docker-compose.cpu.yml up, waits for the gateway, sends a text request twice through the
#    gateway and checks the second one was a cache hit (its /metrics), then docker-compose down
#    With --cluster: the profile's six Redis Cluster nodes, redis-cluster-init and serve-cluster (gateway on 18010)
#    come up; after the same two requests it checks the entry landed in the cluster, docker-kills the master that
#    holds it, sends 10 new prompts (all must succeed), waits for a replica to take over and checks the entry
#    survived and a new one is stored
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
compose() { docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" "${PROFILE[@]}" "$@"; }

CLUSTER=${DSTOOL_IMAGES_CLUSTER:-}
[ "$CLUSTER" = 0 ] && CLUSTER=
positional=()
for arg in "$@"; do
    case $arg in
        --cluster) CLUSTER=1 ;;
        -*) fail "unknown option $arg (usage: scripts/images.sh [--cluster] [MODEL_REPOSITORY])" ;;
        *) positional+=("$arg") ;;
    esac
done
set -- "${positional[@]}"
PROFILE=() SERVE_SERVICE=serve
if [ -n "$CLUSTER" ]; then
    PROFILE=(--profile cluster) SERVE_SERVICE=serve-cluster
    HTTP_PORT=18010 GRPC_PORT=18011 METRICS_PORT=18012   # serve-cluster's, as in docker-compose.cpu.yml
fi

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
if [ -n "$CLUSTER" ]; then
    NODE_PORTS=(6391 6392 6393 6394 6395 6396)   # as in docker-compose.cpu.yml's profile cluster
    CLUSTER_SERVICES=(redis-node-1 redis-node-2 redis-node-3 redis-node-4 redis-node-5 redis-node-6
                      redis-cluster-init serve-cluster)
    PORTS=($HTTP_PORT $GRPC_PORT $METRICS_PORT "${NODE_PORTS[@]}")
    for port in "${NODE_PORTS[@]}"; do PORTS+=($((port + 10000))); done   # the cluster bus
else
    PORTS=($HTTP_PORT $GRPC_PORT $METRICS_PORT $REDIS_PORT)
fi
for port in "${PORTS[@]}"; do
    ss -Hltn "sport = :$port" | grep -q . && fail "port $port is in use (ss -ltnp 'sport = :$port')"
done
trap 'compose down --timeout 30 >/dev/null 2>&1' EXIT
t=$(now)
if [ -n "$CLUSTER" ]; then
    step "docker-compose -f docker-compose.cpu.yml --profile cluster up -d ${CLUSTER_SERVICES[*]}"
    compose up -d --no-build "${CLUSTER_SERVICES[@]}" >"$WORK/compose-up.log" 2>&1 \
        || { compose logs --tail 30 redis-cluster-init >&2; fail "docker-compose up failed (see $WORK/compose-up.log)"; }
    compose logs --no-color redis-cluster-init 2>&1 | grep -E 'redis-cluster-init:|\[OK\]|ERR' | sed 's/^/  /'
    [ "$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$(compose ps -q redis-cluster-init)" 2>/dev/null)" = 0 ] \
        || fail "redis-cluster-init did not exit 0"
    TIMES[cluster]=$(since "$t")
    echo "cluster created and cluster_state:ok on all 6 nodes after ${TIMES[cluster]} s"
else
    step "docker-compose -f docker-compose.cpu.yml up -d"
    compose up -d --no-build >"$WORK/compose-up.log" 2>&1 || fail "docker-compose up failed (see $WORK/compose-up.log)"
fi
cid=$(compose ps -q "$SERVE_SERVICE") && [ -n "$cid" ] || fail "docker-compose started no $SERVE_SERVICE container"
ready=
for _ in $(seq 240); do
    if curl -fsS -o /dev/null "http://127.0.0.1:$HTTP_PORT/v2/health/ready" 2>/dev/null; then ready=1; break; fi
    [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$cid" 2>/dev/null)" = true ] \
        || { compose logs --tail 20 "$SERVE_SERVICE" >&2; fail "the $SERVE_SERVICE container stopped before it was ready"; }
    sleep 0.5
done
[ -n "$ready" ] || { compose logs --tail 20 "$SERVE_SERVICE" >&2; fail "the gateway was not ready after 120 s"; }
TIMES[ready]=$(since "$t")
echo "gateway ready on 127.0.0.1:$HTTP_PORT after ${TIMES[ready]} s"
compose logs --no-color "$SERVE_SERVICE" 2>&1 | grep -m1 'cache:' | sed 's/^[^|]*| */  /'

metric() {   # the sum of a gateway metric's samples whose line matches $1
    curl -fsS "http://127.0.0.1:$HTTP_PORT/metrics" | awk -v re="$1" '$0 ~ re { s += $NF } END { print s + 0 }'
}
hits() { metric '^dstool_gateway_cache_hits_total'; }
infer() {   # infer PROMPT
    if [ -x "$ROOT/.venv/bin/dstool" ]; then
        "$ROOT/.venv/bin/dstool" infer "$1" --url "127.0.0.1:$HTTP_PORT" "${INFER_ARGS[@]}"
    else  # no host venv: the image's own client, through the same gateway port
        compose exec -T "$SERVE_SERVICE" dstool infer "$1" --url "127.0.0.1:$HTTP_PORT" "${INFER_ARGS[@]}"
    fi
}
before=$(hits) || fail "the gateway's /metrics did not answer"
for n in 1 2; do
    t=$(now)
    out=$(infer "$PROMPT" 2>&1) || fail "dstool infer through the gateway failed: $(echo "$out" | tail -1)"
    echo "request $n (dstool infer '$PROMPT' ${INFER_ARGS[*]}) in $(since "$t") s: ${out//$'\n'/\\n}"
    [ "$n" = 1 ] && first=$out
done
[ "$out" = "$first" ] || fail "the second answer differs from the first"
after=$(hits)
echo "dstool_gateway_cache_hits_total: $before -> $after"
[ "$after" -gt "$before" ] || fail "the gateway reported no cache hit for the repeated request"

if [ -z "$CLUSTER" ]; then
    keys=$(compose exec -T redis redis-cli -p "$REDIS_PORT" dbsize | tr -d '\r')
    echo "redis keys (dbsize): $keys"
    [ "${keys:-0}" -gt 0 ] || fail "the gateway stored nothing in Redis"
else
    VIA=redis-node-1   # the node container whose redis-cli reaches the others (host networking)
    rcli() { compose exec -T "$VIA" redis-cli "$@" | tr -d '\r'; }
    masters() {   # HOST:PORT of each master not marked failed, as node port $1 sees them
        rcli -p "$1" cluster nodes | awk '$3 ~ /master/ && $3 !~ /fail/ { split($2, a, "[@,]"); print a[1] }' | sort
    }
    cluster_keys() {   # dbsize summed over the masters
        local s=0 k m
        for m in $(masters "$1"); do k=$(rcli -h "${m%:*}" -p "${m##*:}" dbsize); s=$((s + ${k:-0})); done
        echo "$s"
    }
    echo "masters: $(masters 6391 | tr '\n' ' ')"
    keys=$(cluster_keys 6391)
    echo "cluster keys (dbsize summed over the masters): $keys"
    [ "$keys" -gt 0 ] || fail "the gateway stored nothing in the Redis Cluster"
    holder= key=
    for m in $(masters 6391); do
        key=$(rcli -h "${m%:*}" -p "${m##*:}" --scan | head -1)
        [ -n "$key" ] && { holder=$m; break; }
    done
    [ -n "$holder" ] || fail "no master holds the gateway's key"
    echo "the entry: key ${key:0:40}... (slot $(rcli -p 6391 cluster keyslot "$key")) on master $holder;" \
         "redis-cli -c -p 6391 exists: $(rcli -c -p 6391 exists "$key")"

    # ---- a master killed: requests go on (Triton answers while the slot has no master), a replica takes over
    port=${holder##*:}
    victim=redis-node-$((port - 6390))
    [ "$victim" = "$VIA" ] && VIA=redis-node-$(( (port - 6390) % 6 + 1 ))
    alive=$(( ${VIA##*-} + 6390 ))   # a node port that stays up
    errors_before=$(metric '^dstool_gateway_errors_total[{]kind="redis"')
    step "docker kill $victim (master $holder), then 10 new prompts through the gateway"
    "$DOCKER" kill "$(compose ps -q "$victim")" >/dev/null || fail "docker kill $victim failed"
    killed=$(now)
    t=$(now)
    for i in $(seq 10); do
        p="JULIET $i:"
        t1=$(now)
        out=$(infer "$p" 2>&1) || fail "request '$p' after the kill failed: $(echo "$out" | tail -1)"
        echo "  +$(since "$killed") s: '$p' in $(since "$t1") s: ${out//$'\n'/\\n}"
    done
    TIMES[after_kill]=$(since "$t")
    echo "10/10 requests after the kill succeeded in ${TIMES[after_kill]} s;" \
         "dstool_gateway_errors_total{kind=\"redis\"}: $errors_before -> $(metric '^dstool_gateway_errors_total[{]kind="redis"')"
    promoted=
    for _ in $(seq 60); do
        if rcli -p "$alive" cluster info | grep -q '^cluster_state:ok' \
            && [ "$(masters "$alive" | grep -vc ":$port\$")" = 3 ] && ! masters "$alive" | grep -q ":$port\$"; then
            promoted=1; break
        fi
        sleep 0.5
    done
    [ -n "$promoted" ] || fail "no replica took over from $holder within 30 s"
    TIMES[failover]=$(since "$killed")
    echo "failover: cluster_state:ok with 3 masters ($(masters "$alive" | tr '\n' ' ')) ${TIMES[failover]} s after the kill"
    [ "$(rcli -c -p "$alive" exists "$key")" = 1 ] || fail "the first entry was lost with its master"
    keys_failover=$(cluster_keys "$alive")
    echo "the first entry survived on the promoted replica; cluster keys: $keys_failover"
    # the gateway's client may still hold the old map (it read it again during the outage): its first call to the
    # dead master's slots fails once (Triton answers), then it reads the new map
    for p in "ROMEO and JULIET:" "TYBALT:" "MERCUTIO:"; do
        out=$(infer "$p" 2>&1) || fail "request '$p' after the failover failed: $(echo "$out" | tail -1)"
        echo "  after the failover: '$p': ${out//$'\n'/\\n}"
    done
    sleep 0.5   # the gateway stores in the background
    keys_after=$(cluster_keys "$alive")
    echo "cluster keys: $keys_failover -> $keys_after (3 new prompts after the failover);" \
         "dstool_gateway_errors_total{kind=\"redis\"}: $(metric '^dstool_gateway_errors_total[{]kind="redis"')"
    [ "$keys_after" -gt "$keys_failover" ] || fail "the gateway stored nothing in the cluster after the failover"
fi

step "docker-compose down"
compose down --timeout 30 >"$WORK/compose-down.log" 2>&1 || fail "docker-compose down failed (see $WORK/compose-down.log)"
trap - EXIT

step "images"
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^($BASE|$SERVE|$REDIS) " | sort
step "times (s)"
for k in apt base model serve redis cluster ready after_kill failover; do [ -n "${TIMES[$k]:-}" ] && echo "$k: ${TIMES[$k]}"; done
echo "dockerd left running on $SOCK (pid $(cat "$WORK/dockerd.pid" 2>/dev/null || echo '?'))"
echo "images.sh: OK"
