# corolla's image: a Python venv at /opt/corolla installed from wheels built on the host, so the build needs no
# network (`docker build --network none`). The default command runs the demo: a private loopback swarm of the shipped
# demo model (a bootstrap node, two servers, the health page and the OpenAI API inside the container) and one
# streamed generation. Any corolla command runs too: `docker run --rm corolla corolla-server --help`.
#
# CPU (built and tested here: tests/integration/test_docker_image.py):
#   docker/make-base-image.sh            # corolla-base:bookworm, made with debootstrap (no Docker Hub needed)
#   docker/build-wheels.sh               # docker/wheels: torch 2.13.0+cpu, hivemind, ..., corolla
#   docker build --network none -t corolla .
#   docker run --rm --network none corolla
# GPU (a CUDA base image and CUDA torch wheels for that image's Python, e.g. Ubuntu 24.04's 3.12):
#   PYTHON=python3.12 PYTHON_VERSION=3.12 TORCH_SPEC=torch==2.13.0 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
#     docker/build-wheels.sh            # bitsandbytes (nf4, the CUDA default) is a dependency on Linux already
#   docker build --build-arg BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 -t corolla:cuda .
#   docker run --rm --gpus all --network host corolla:cuda corolla-server ORG/MODEL --initial_peers ...
# A base without Python (the nvidia/cuda images) gets python3, python3-venv and tini from its own apt sources, so that
# one build needs the network for apt (leave out `--network none` there). tini runs as PID 1: it forwards signals and
# reaps the orphaned grandchildren (p2pd daemons) of corolla's processes, which a Python PID 1 would leave as zombies.
ARG BASE=corolla-base:bookworm

FROM ${BASE} AS base
RUN if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || ! [ -x /usr/bin/tini ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
            tini \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# Dependencies in their own stage and layer: rebuilt only when docker/wheels/deps changes, not for a corolla change.
FROM base AS deps
COPY docker/wheels/deps /tmp/wheels
RUN python3 -m venv /opt/corolla \
    && /opt/corolla/bin/pip install --no-index --no-cache-dir --disable-pip-version-check --find-links /tmp/wheels \
        /tmp/wheels/*.whl

FROM base
COPY --from=deps /opt/corolla /opt/corolla
COPY docker/wheels/corolla /tmp/corolla-wheel
RUN /opt/corolla/bin/pip install --no-index --no-deps --no-cache-dir --disable-pip-version-check /tmp/corolla-wheel/*.whl \
    && rm -rf /tmp/corolla-wheel \
    && /opt/corolla/bin/pip check --disable-pip-version-check
ENV PATH=/opt/corolla/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LANG=C.UTF-8
WORKDIR /work
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python", "-m", "corolla.cli.demo"]
