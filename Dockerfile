# The kvmesh image, installed the way the README does (`pip install -e .`).
#   docker build -t kvmesh .                                  # mocker / CPU fleet
#   docker build -t kvmesh-vllm --build-arg EXTRA_PIP=vllm .  # + vLLM for GPU workers
# The entrypoint is the `kvmesh` CLI: `kvmesh frontend …`, `kvmesh worker …`, or
# `kvmesh run` (embedded, the default command) for a one-container try.
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
