#!/usr/bin/env bash
# Build the gptforge image for this host: `make image`, or
#   docker/build.sh [--cpu | --gpu] [--base IMAGE] [--tag TAG] [-- EXTRA DOCKER BUILD ARGS]
#
# --gpu: the CUDA base (nvidia/cuda, pulled), a uv-managed Python, torch from PyTorch's CUDA index
#        (TORCH_CUDA, default cu130), vLLM; tag gptforge-gpu:latest, pool `gpu`.
# --cpu: a Debian base, its own Python 3.11, the CPU build of torch, no vLLM; tag
#        gptforge-cpu:latest, pool `cpu`.
# Neither: --gpu where `nvidia-smi` answers, else --cpu.
#
# The base is --base, else BASE_IMAGE, else the variant's default; a CPU build whose default base
# (debian:bookworm-slim) cannot be pulled uses gptforge-base:bookworm, made here once with
# debootstrap from Debian's own mirror (root). The CPU torch comes from PyTorch's CPU index when it
# answers, else from docker/wheelhouse, filled by the host's pip (`pip download`). The host's CA
# bundle (PIP_CERT, pip's global.cert, or Debian's bundle) reaches the build as a BuildKit secret,
# never a layer; PIP_INDEX_URL / PIP_EXTRA_INDEX_URL pass through as build arguments.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=docker/lib.sh
. "$ROOT/docker/lib.sh"

variant="" base="${BASE_IMAGE:-}" tag="${GPTFORGE_IMAGE:-}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cpu) variant=cpu ;;
        --gpu) variant=gpu ;;
        --base) base="${2:?--base needs an image}"; shift ;;
        --tag) tag="${2:?--tag needs a name}"; shift ;;
        --) shift; break ;;
        *) die "docker/build.sh: unknown argument $1 (use --cpu, --gpu, --base IMAGE, --tag TAG, -- DOCKER ARGS)" ;;
    esac
    shift
done
if [[ -z "$variant" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then variant=gpu; else variant=cpu; fi
fi
tag="${tag:-gptforge-${variant}:latest}"
torch_version="$(sed -n 's/^ *"torch==\([^"]*\)",.*/\1/p' "$ROOT/pyproject.toml" | head -n 1)"
[[ -n "$torch_version" ]] || die "docker/build.sh: no torch==VERSION pin found in pyproject.toml"

need_engine
started=$SECONDS

# An image this engine has, or can pull: true/false, no output.
have_image() {
    docker image inspect "$1" >/dev/null 2>&1 || docker pull --quiet "$1" >/dev/null 2>&1
}

debian_base() {
    local name=gptforge-base:bookworm rootfs
    if docker image inspect "$name" >/dev/null 2>&1; then echo "$name"; return; fi
    [[ "$(id -u)" == 0 ]] || die "docker/build.sh: no registry answers and $name does not exist; making it needs root (debootstrap), or pass --base IMAGE"
    if ! command -v debootstrap >/dev/null 2>&1; then
        echo "build: installing debootstrap" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
            || die "docker/build.sh: cannot install debootstrap (apt-get install debootstrap), or pass --base IMAGE"
    fi
    rootfs="$(mktemp -d)"
    echo "build: no registry answers; making $name with debootstrap (about 30 s)" >&2
    debootstrap --variant=minbase bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null \
        || { rm -rf "$rootfs"; die "docker/build.sh: debootstrap of Debian bookworm failed (mirror ${DEBIAN_MIRROR:-http://deb.debian.org/debian})"; }
    tar -C "$rootfs" -c . | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$name" >/dev/null
    rm -rf "$rootfs"
    echo "$name"
}

args=()
if [[ "$variant" == gpu ]]; then
    base="${base:-nvidia/cuda:13.0.2-base-ubuntu24.04}"
    have_image "$base" || die "docker/build.sh: BASE_IMAGE $base does not exist here and cannot be pulled"
    torch_flavour="${TORCH_CUDA:-cu130}"
    args+=(--build-arg "PYTHON_SOURCE=${PYTHON_SOURCE:-uv}" --build-arg "WORK_POOL=gpu")
else
    if [[ -n "$base" ]]; then
        have_image "$base" || die "docker/build.sh: BASE_IMAGE $base does not exist here and cannot be pulled"
    elif have_image debian:bookworm-slim; then
        base=debian:bookworm-slim
    else
        base="$(debian_base)"
    fi
    torch_flavour=cpu
    args+=(--build-arg "PYTHON_SOURCE=${PYTHON_SOURCE:-system}" --build-arg "WORK_POOL=cpu" --build-arg "VLLM_VERSION=")
    # The CPU torch: from PyTorch's CPU index in the build when it answers, else a wheel made here.
    mkdir -p "$ROOT/docker/wheelhouse"
    wheel_glob="torch-${torch_version}+cpu-*.whl"
    if ! compgen -G "$ROOT/docker/wheelhouse/$wheel_glob" >/dev/null \
        && ! python3 -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/', timeout=5)" >/dev/null 2>&1; then
        echo "build: PyTorch's index does not answer; torch==${torch_version}+cpu into docker/wheelhouse through the host's pip" >&2
        python3 -m pip download --quiet --no-deps --dest "$ROOT/docker/wheelhouse" "torch==${torch_version}+cpu" \
            || die "docker/build.sh: torch==${torch_version}+cpu is neither on PyTorch's index nor in the host's pip sources; put its wheel in docker/wheelhouse"
    fi
fi
args+=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_CUDA=$torch_flavour")

# Certificates for pip and uv inside the build: a secret, mounted only while a step installs.
cert="${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}"
[[ -n "$cert" ]] || cert=/etc/ssl/certs/ca-certificates.crt
if [[ -s "$cert" ]]; then
    args+=(--secret "id=cacert,src=$cert")
fi
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
    if [[ -n "${!name:-}" ]]; then args+=(--build-arg "$name=${!name}"); fi
done
commit="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
args+=(--build-arg "GIT_COMMIT=$commit")

echo "build: $tag ($variant) from $base, torch ${torch_version}+${torch_flavour}" >&2
buildkit_build -f "$ROOT/docker/Dockerfile" -t "$tag" "${args[@]}" "$@" "$ROOT"
size="$(docker image inspect --format '{{.Size}}' "$tag")"
echo "build: $tag built in $((SECONDS - started)) s, $((size / 1000000)) MB"
