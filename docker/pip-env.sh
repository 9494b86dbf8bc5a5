# Sourced by the Dockerfile's install steps: where pip and uv find packages and whom they trust.
# Nothing here is written into a layer: the CA bundle is a BuildKit secret (/run/secrets/cacert,
# `docker build --secret id=cacert,src=FILE`; docker/build.sh passes the host's), the wheelhouse a
# bind mount of docker/wheelhouse, and the index URLs build arguments (PIP_INDEX_URL,
# PIP_EXTRA_INDEX_URL; empty: PyPI).
if [ -s /run/secrets/cacert ]; then
    export PIP_CERT=/run/secrets/cacert SSL_CERT_FILE=/run/secrets/cacert
fi
if [ -n "${PIP_INDEX_URL:-}" ]; then
    export UV_DEFAULT_INDEX="${PIP_INDEX_URL}"
else
    unset PIP_INDEX_URL
fi
if [ -n "${PIP_EXTRA_INDEX_URL:-}" ]; then
    export UV_INDEX="${PIP_EXTRA_INDEX_URL}"
else
    unset PIP_EXTRA_INDEX_URL
fi
# Wheels made on the host (docker/build.sh --wheelhouse: `pip download` into docker/wheelhouse):
# taken before the index's.
if ls /wheelhouse/*.whl >/dev/null 2>&1; then
    export PIP_FIND_LINKS=/wheelhouse UV_FIND_LINKS=/wheelhouse
fi
