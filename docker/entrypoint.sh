#!/usr/bin/env bash
# Entry point of the gptforge GPU image.
#   (no argument) or `worker [ARGS...]`: start the Prefect worker of pool $PREFECT_WORK_POOL
#       (default gpu) of type $PREFECT_WORKER_TYPE (default docker); ARGS go to
#       `prefect worker start` (e.g. --limit 1).
#   anything else: run it as given. The Docker worker starts each flow run in this image with
#       `prefect flow-run execute`; `docker run IMAGE gptforge pretrain` runs a stage by hand.
set -euo pipefail

# prepare_instruct's DVC dependency: git carries data/synthetic in a clone, but a data volume
# made before it existed lacks it (docs/synthesize.md).
mkdir -p /workspace/gptforge/data/synthetic 2>/dev/null || true


if [[ $# -gt 0 && "$1" != "worker" ]]; then
    exec "$@"
fi
[[ $# -gt 0 ]] && shift

if [[ -z "${PREFECT_API_URL:-}" ]]; then
    echo "gptforge worker: PREFECT_API_URL is not set; a worker needs a Prefect server" \
        "(e.g. PREFECT_API_URL=http://prefect-server:4200/api)" >&2
    exit 2
fi

pool="${PREFECT_WORK_POOL:-gpu}"
type="${PREFECT_WORKER_TYPE:-docker}"
args=(worker start --pool "$pool" --type "$type")

# A Docker pool the worker has to create gets gptforge's job template (GPU request, image,
# network, volumes) instead of the bare default; an existing pool keeps its own template.
# The image, network, volume names and MLflow URI of this compose project are written into its
# defaults.
if [[ "$type" == "docker" && -f "${GPTFORGE_POOL_TEMPLATE:-}" ]]; then
    template="$(mktemp --suffix=.json)"
    python - "$GPTFORGE_POOL_TEMPLATE" "$template" <<'PY'
import json
import os
import sys

src, dst = sys.argv[1:3]
with open(src) as f:
    template = json.load(f)
props = template["variables"]["properties"]
if os.environ.get("GPTFORGE_IMAGE"):
    props["image"]["default"] = os.environ["GPTFORGE_IMAGE"]
if os.environ.get("GPTFORGE_NETWORK"):
    props["networks"]["default"] = [os.environ["GPTFORGE_NETWORK"]]
# The compose file names its volumes PREFIX-dvc-cache, PREFIX-data, ... (default gptforge).
prefix = os.environ.get("GPTFORGE_VOLUME_PREFIX")
if prefix:
    props["volumes"]["default"] = [
        prefix + v[len("gptforge"):] if v.startswith("gptforge-") else v for v in props["volumes"]["default"]
    ]
env = props["env"].setdefault("default", {})
if os.environ.get("MLFLOW_TRACKING_URI"):
    env["MLFLOW_TRACKING_URI"] = os.environ["MLFLOW_TRACKING_URI"]
with open(dst, "w") as f:
    json.dump(template, f)
PY
    args+=(--base-job-template "$template")
fi

exec prefect "${args[@]}" "$@"
