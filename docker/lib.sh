# Shell helpers of docker/build.sh and docker/check.sh (sourced, not run).
#   die MESSAGE            the one-line reason, last on stderr, exit 2
#   need_engine            a Docker engine answers, or die saying how to start one
#   buildkit_build ARGS    `docker build ARGS` through BuildKit, with whichever client has it

die() {
    echo "$*" >&2
    exit 2
}

need_engine() {
    command -v docker >/dev/null 2>&1 \
        || die "gptforge docker: no docker client; install Docker (Debian: apt-get install -y docker.io)"
    if ! docker info >/dev/null 2>&1; then
        die "gptforge docker: no Docker engine answers at ${DOCKER_HOST:-/var/run/docker.sock}; start one (as root: nohup dockerd --storage-driver=overlay2 >/var/log/dockerd.log 2>&1 &, or systemctl start docker)"
    fi
}

# BuildKit: `docker buildx build --load` where the buildx plugin is installed; else a client of
# Docker 18.09-22.x, which has BuildKit built in (DOCKER_BUILDKIT=1). Clients from 23 on need
# buildx for it (a newer client may stand first on PATH beside Debian's docker.io 20.10).
buildkit_build() {
    if docker buildx version >/dev/null 2>&1; then
        docker buildx build --load "$@"
        return
    fi
    local client major
    for client in docker /usr/bin/docker; do
        command -v "$client" >/dev/null 2>&1 || continue
        major="$("$client" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)"
        if [[ "$major" =~ ^[0-9]+$ ]] && ((major >= 18 && major < 23)); then
            DOCKER_BUILDKIT=1 "$client" build "$@"
            return
        fi
    done
    die "gptforge docker: the build needs BuildKit (secrets, bind mounts): install the buildx plugin (Debian 13: docker-buildx) or use Docker 20.10's own client (Debian 12: docker.io)"
}
