#!/usr/bin/env bash
# Download into .whl/ the wheels that a GPU machine without network or package index
# needs to run kvmesh from src/: the runtime dependencies of kvmesh (pyproject.toml
# [project] dependencies, and theirs) that its Python 3.12 image lacks. One version
# each, binary only, --no-deps (the list below *is* the dependency closure).
#
# Run from the repository root (here, with network):
#     bash scripts/gpu_wheels.sh
# On the GPU machine (a copy of the repository, .whl/ included):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#         --upgrade --target /tmp/site .whl/*.whl
#     export PYTHONPATH=/tmp/site:src
#
# The image already has: tokenizers, jinja2, markupsafe, xxhash, numpy, uvloop,
# prometheus-client, grpcio, protobuf, httpx, tqdm, safetensors, typing-extensions,
# torch, transformers, accelerate, ... so none of those are downloaded.
#
# Left out on purpose:
#   opentelemetry-*  imported only when OTEL_EXPORT_ENABLED=1 (kvmesh/observability/tracing.py)
#   gguf             only for `--model smollm2` (the GGUF conversion)
set -euo pipefail

PY=${PYTHON:-python3}
DEST=.whl

if [[ ! -f pyproject.toml || ! -d src/kvmesh ]]; then
    echo "gpu_wheels.sh: run me from the kvmesh repository root" >&2
    exit 1
fi

# NAME==VERSION: the versions pip resolves for kvmesh on Python 3.11 here.
WHEELS=(
    # imported at start (the frontend, the HTTP parser, guided decoding)
    "msgspec==0.22.0"
    "httptools==0.9.0"
    "llguidance==1.9.1"
    # the zmq event plane (the KV router's event subscriber / publishers)
    "pyzmq==27.3.0"
    # distributed mode only (kvmesh frontend/worker with etcd and NATS); small
    "aetcd==1.0.0"            # needs grpcio, protobuf: in the image
    "nats-py==2.16.0"
    "pynacl==1.6.2"           # needed by nkeys
    "cffi==2.0.0"             # needed by pynacl
    "pycparser==3.0"          # needed by cffi
)

# llguidance ships only manylinux_2_31 wheels: the image (Python 3.12.3, Ubuntu 24.04,
# glibc 2.39) runs those; 2.35 is the newest tag accepted here
# pure-Python packages published only as an sdist: built into a py3-none-any wheel here
SDIST_ONLY=(
    "nkeys==0.2.1"            # nats-py[nkeys]: signs the nonce with a .creds file
)

PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64
           manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64
           manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64 manylinux_2_5_x86_64)
PLATFORM_ARGS=()
for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    # drop another version of the same package left by an earlier run (one version each)
    norm=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
    for old in "$DEST"/*.whl; do
        [[ -e "$old" ]] || continue
        base=$(basename "$old")
        oname=$(echo "${base%%-*}" | tr '[:upper:]-' '[:lower:]_')
        over=$(echo "$base" | cut -d- -f2)
        if [[ "$oname" == "$norm" && "$over" != "${spec##*==}" ]]; then
            rm -f "$old"
        fi
    done
    "$PY" -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${PLATFORM_ARGS[@]}" \
        -d "$DEST" "$spec"
done

for spec in "${SDIST_ONLY[@]}"; do
    name=${spec%%==*}
    rm -f "$DEST/${name}"-*.whl
    "$PY" -m pip wheel -q --no-deps --no-binary="$name" -w "$DEST" "$spec"
    ls "$DEST/${name}"-*-py3-none-any.whl >/dev/null   # must be pure Python
done

echo "wheels in $DEST:"
ls -l "$DEST"/*.whl | awk '{printf "  %8d  %s\n", $5, $NF}'
total=$(cat "$DEST"/*.whl | wc -c)
echo "total: $total bytes ($(awk -v b="$total" 'BEGIN{printf "%.2f", b/1048576}') MiB) in $(ls "$DEST"/*.whl | wc -l) wheels"
