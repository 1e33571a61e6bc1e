#!/usr/bin/env bash
# Container smoke test: build the Dockerfile with buildah and serve real JPEGs from the image.
#
# There is no Docker engine or registry here, so the base image is made locally: debootstrap a minbase bookworm
# rootfs from the Debian mirror apt already uses and import it as debian:bookworm-slim. Then `buildah bud` the
# Dockerfile, run the image's own ENTRYPOINT with `buildah run` (podman run fails on rlimits in this sandbox),
# wait for /readyz, run the image's HEALTHCHECK command, classify JPEGs and compare with the same SavedModel
# loaded locally, check 4xx errors, then SIGTERM the server and expect a clean drain.
#
# Needs root. Installs buildah and debootstrap with apt when missing. Env knobs:
#   PETAL_SMOKE_CONTEXT  build context (default: the repository root)
#   PETAL_SMOKE_CACHE    where the debootstrap tarball is kept between runs (default: /var/cache/petal-smoke)
#   PETAL_SMOKE_IMAGE    tag to build (default: localhost/petal:smoke)
#   PYTHON               interpreter with Petal installed, for the checks (default: .venv/bin/python)
#   PETAL_SMOKE_REUSE_IMAGE=1  keep the image afterwards, and skip the build when it already exists (to iterate
#                        on the run checks); by default the image is removed at the end
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CONTEXT=${PETAL_SMOKE_CONTEXT:-$ROOT}
CACHE=${PETAL_SMOKE_CACHE:-/var/cache/petal-smoke}
IMAGE=${PETAL_SMOKE_IMAGE:-localhost/petal:smoke}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BASE=docker.io/library/debian:bookworm-slim
CHECK=(env PYTHONPATH="$ROOT" TF_CPP_MIN_LOG_LEVEL=3 "$PYTHON" "$ROOT/tests/container/check.py")
GRACEFUL_TIMEOUT=5
STARTED=$(date +%s)
WORK=$(mktemp -d)
CONTAINER=""
RUNNER=""
SERVER=""

log() { printf '[smoke %4ss] %s\n' "$(($(date +%s) - STARTED))" "$*" >&2; }

cleanup() {
    local status=$?
    if [[ -n $SERVER ]] && kill -0 "$SERVER" 2>/dev/null; then kill -KILL "$SERVER" 2>/dev/null || true; fi
    if [[ -n $RUNNER ]] && kill -0 "$RUNNER" 2>/dev/null; then kill -KILL "$RUNNER" 2>/dev/null || true; fi
    if [[ -n $RUNNER ]]; then wait "$RUNNER" 2>/dev/null || true; fi
    if [[ -n $CONTAINER ]]; then buildah rm "$CONTAINER" >/dev/null 2>&1 || true; fi
    # The tag goes unless asked to keep it; the layers stay as buildah's cache (--layers), so the next build reuses
    # the 2 GB of dependencies and adds only the few MB that Petal's code changed.
    if [[ -z ${PETAL_SMOKE_REUSE_IMAGE:-} ]]; then buildah rmi "$IMAGE" >/dev/null 2>&1 || true; fi
    if ((status != 0)); then
        for f in "$WORK"/*.log; do [[ -s $f ]] && { echo "--- last lines of $f" >&2; tail -n 40 "$f" >&2; }; done
        log "FAILED"
    fi
    rm -rf "$WORK"
    exit "$status"
}
trap cleanup EXIT

install_tools() {
    local missing=()
    command -v buildah >/dev/null || missing+=(buildah)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} with apt"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >"$WORK/apt.log"
    fi
}

# The first Debian (not security) archive URL in apt's own sources, so debootstrap uses the reachable mirror.
debian_mirror() {
    local mirror
    mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | grep -E '^[[:space:]]*(deb|URIs:)[[:space:]]' | grep -oE 'https?://[^[:space:]]+' \
        | grep -v -- '-security' | grep -E '/debian/?$' | head -n 1 || true)
    echo "${mirror:-http://deb.debian.org/debian}"
}

# debian:bookworm-slim, made here: a minbase rootfs without apt lists, docs, man pages and locales.
import_base_image() {
    if buildah inspect --type image "$BASE" >/dev/null 2>&1; then
        log "base image $BASE already in local storage"
        return
    fi
    local tarball=$CACHE/bookworm-minbase.tar rootfs container
    if [[ ! -s $tarball ]]; then
        local mirror
        mirror=$(debian_mirror)
        log "debootstrap --variant=minbase bookworm from $mirror"
        rootfs=$WORK/rootfs
        debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
            "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
        mkdir -p "$CACHE"
        tar --numeric-owner -C "$rootfs" -cf "$tarball.partial" .
        mv "$tarball.partial" "$tarball"
        rm -rf "$rootfs"
    fi
    log "importing $tarball as $BASE"
    container=$(buildah from scratch)
    buildah add --quiet "$container" "$tarball" / >/dev/null
    buildah config --cmd '["bash"]' --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        "$container"
    buildah commit --quiet --rm "$container" "$BASE" >/dev/null
}

# When the host's pip trusts an extra CA (PIP_CERT or pip.conf, as behind a TLS-inspecting proxy), lend that
# trust to the build's RUN steps through bind mounts, which never reach the image's layers.
pip_trust_volumes() {
    local cert=${PIP_CERT:-}
    if [[ -z $cert ]]; then
        cert=$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.cert='\(.*\)'$/\1/p" | head -n 1)
    fi
    [[ -n $cert && -f $cert ]] || return 0
    printf '[global]\ncert = /etc/petal-build-ca.crt\n' >"$WORK/pip.conf"
    printf '%s\0' --volume "$cert:/etc/petal-build-ca.crt:ro" --volume "$WORK/pip.conf:/etc/pip.conf:ro"
}

build_image() {
    local volumes=()
    mapfile -d '' volumes < <(pip_trust_volumes)
    log "buildah bud $CONTEXT -> $IMAGE (build steps follow, full log on failure)"
    buildah bud --isolation chroot --format docker --pull=never --layers "${volumes[@]}" \
        -f "$CONTEXT/Dockerfile" -t "$IMAGE" "$CONTEXT" 2>&1 \
        | tee "$WORK/build.log" | while IFS= read -r line; do
            if [[ $line =~ ^(\[[0-9]+/[0-9]+\]\ )?STEP\ [0-9]+/[0-9]+:\ (FROM|RUN|COPY) ]]; then log "${line:0:110}"; fi
        done
    log "built $IMAGE: $(buildah images --format '{{.Size}}' "$IMAGE" | head -n 1)"
}

# Distinct free loopback ports, all chosen while each is still bound (load_tests/launcher.py).
free_ports() { "$PYTHON" -c "from load_tests.launcher import free_ports; print(*free_ports($1))"; }

# The server: the topmost process under buildah's runner running `petal serve` (buildah's own helper processes
# carry the entrypoint's text in their arguments too, so match on the program and subcommand).
find_server() {
    local deadline=$((SECONDS + 60)) pid argv
    while ((SECONDS < deadline)); do
        for pid in $(descendants "$RUNNER"); do
            mapfile -d '' argv <"/proc/$pid/cmdline" 2>/dev/null || continue
            if [[ ${#argv[@]} -ge 3 && ${argv[1]} == */petal && ${argv[2]} == serve ]]; then
                echo "$pid"
                return
            fi
        done
        sleep 0.5
    done
    return 1
}

descendants() {
    local child
    # shellcheck disable=SC2013  # the children files hold space-separated pids, not lines
    for child in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

main() {
    ((EUID == 0)) || { log "needs root: debootstrap and buildah's chroot isolation"; exit 1; }
    install_tools
    [[ -d $CONTEXT/exported_models/flowers ]] || { log "no default model at $CONTEXT/exported_models/flowers"; exit 1; }
    if [[ -n ${PETAL_SMOKE_REUSE_IMAGE:-} ]] && buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
        log "reusing $IMAGE (PETAL_SMOKE_REUSE_IMAGE is set)"
    else
        import_base_image
        build_image
    fi

    local config
    config=$(buildah inspect --type image "$IMAGE")
    "${CHECK[@]}" config <<<"$config"
    local entrypoint=() healthcheck=()
    mapfile -d '' entrypoint < <("${CHECK[@]}" config --argv entrypoint <<<"$config")
    mapfile -d '' healthcheck < <("${CHECK[@]}" config --argv healthcheck <<<"$config")
    log "image config: non-root, ports 8500/8501, MODEL_NAME, HEALTHCHECK on /readyz, exec entrypoint"

    local rest grpc
    read -r rest grpc < <(free_ports 2)
    CONTAINER=$(buildah from --pull=never "$IMAGE")
    log "running the entrypoint with extra flags --rest_api_port=$rest --port=$grpc"
    buildah run --isolation chroot "$CONTAINER" -- "${entrypoint[@]}" \
        --rest_api_port="$rest" --port="$grpc" --graceful_timeout="$GRACEFUL_TIMEOUT" >"$WORK/server.log" 2>&1 &
    RUNNER=$!
    SERVER=$(find_server) || { log "no 'petal serve' process appeared under buildah run"; exit 1; }
    # exec in the entrypoint means no shell sits between buildah's exec helper and the server to swallow SIGTERM.
    local parent uid
    [[ -r /proc/$SERVER/status ]] || { log "the server (pid $SERVER) exited right after it started"; exit 1; }
    parent=$(ps -o comm= -p "$(awk '/^PPid:/ {print $2}' "/proc/$SERVER/status")")
    uid=$(awk '/^Uid:/ {print $2}' "/proc/$SERVER/status")
    if [[ $parent == *sh || $uid != 10001 ]]; then
        log "server runs under $parent as uid $uid; expected no shell in between and uid 10001"
        exit 1
    fi
    log "server pid $SERVER runs as uid $uid directly under $parent"

    "${CHECK[@]}" serve --url "http://127.0.0.1:$rest" --model_dir "$CONTEXT/exported_models/flowers" \
        --runner_pid "$RUNNER"
    local pids rss_kib
    pids=$( (echo "$SERVER"; descendants "$SERVER") | paste -s -d ,)
    rss_kib=$(ps -o rss= -p "$pids" | awk '{s += $1} END {print s}')
    log "server memory after serving: $((rss_kib / 1024)) MiB RSS (master and worker)"
    # The HEALTHCHECK targets the default REST port; this run moved it, so point the same command at the new one.
    local probe=("${healthcheck[@]//:8501\//:$rest/}")
    buildah run --isolation chroot "$CONTAINER" -- "${probe[@]}" || { log "HEALTHCHECK command failed"; exit 1; }
    log "HEALTHCHECK command passes inside the container"
    buildah run --isolation chroot "$CONTAINER" -- python3 -c "import s3fs, gcsfs, adlfs" \
        || { log "the object stores' clients (PETAL_EXTRAS=cloud) are missing from the image"; exit 1; }
    log "s3fs, gcsfs and adlfs import inside the container: MODEL_BASE_PATH may be s3://, gs:// or az://"

    kill -TERM "$SERVER"
    local status=0 deadline=$((SECONDS + GRACEFUL_TIMEOUT + 20))
    while kill -0 "$RUNNER" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -0 "$RUNNER" 2>/dev/null && { log "server still running $((GRACEFUL_TIMEOUT + 20))s after SIGTERM"; exit 1; }
    wait "$RUNNER" || status=$?
    RUNNER=""
    ((status == 0)) || { log "server exited with status $status after SIGTERM"; exit 1; }
    if grep -q Traceback "$WORK/server.log"; then log "traceback in the server log"; exit 1; fi
    log "SIGTERM drained and exited 0"
    log "PASSED in $(($(date +%s) - STARTED))s; $IMAGE is $(buildah images --format '{{.Size}}' "$IMAGE" | head -n 1)"
}

main "$@"
