# The kvmesh image, installed the way the README does (`pip install -e .`).
#   docker build -t kvmesh .                                  # mocker / CPU fleet
#   docker build -t kvmesh-vllm --build-arg EXTRA_PIP=vllm .  # + vLLM for GPU workers
# The entrypoint is the `kvmesh` CLI: `kvmesh frontend …`, `kvmesh worker …`, or
# `kvmesh run` (embedded, the default command) for a one-container try.
# The default command serves every address of the container, so it wants API keys: it
# exits at once, saying so, without them. Mount a keys file (`KEY [TIER]` per line,
# readable by uid 10001) and name it; keys never go in the command or in `-e KEY=…`:
#   docker run -p 8000:8000 -v "$PWD/keys.txt:/run/secrets/kvmesh-keys:ro" \
#       -e KVMESH_API_KEYS_FILE=/run/secrets/kvmesh-keys kvmesh
# KVMESH_ALLOW_UNAUTHENTICATED=1 serves without keys, for a proxy in front that checks callers.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG EXTRA_PIP=""
RUN useradd --uid 10001 --create-home kvmesh
WORKDIR /opt/kvmesh
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir -e . \
    && if [ -n "$EXTRA_PIP" ]; then pip install --no-cache-dir $EXTRA_PIP; fi
USER 10001
ENV HOME=/home/kvmesh PYTHONUNBUFFERED=1
EXPOSE 8000 9000 9100
ENTRYPOINT ["kvmesh"]
CMD ["run", "--http-host", "0.0.0.0"]
