# One image, two commands: `kiln compile-server` and `kiln exec-server` (docker-compose.yml runs both).
#
# A bundle's cache key holds the torch, triton and CUDA versions and the GPU it was compiled for, and the execute
# service refuses a bundle built for another environment: run both services from this one image.
#   docker build -t kiln .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime -t kiln .
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# Inductor's CPU backend and Triton's launcher stubs are C/C++ built at run time; the runtime base has no compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*

# Everything that outlives a container sits under two volume paths: the artifact store (shared between the
# services) and this container's own compiler caches (Inductor, Triton, Hugging Face).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KILN_STORE=/var/lib/kiln/store \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/kiln/inductor \
    TRITON_CACHE_DIR=/var/cache/kiln/triton \
    HF_HOME=/var/cache/kiln/huggingface

# Named volumes copy the ownership of the directory they mount over, so the non-root user owns them from the start.
# /etc/kiln/keys and /etc/kiln/signing hold what `kiln keygen` writes (compose's one-shot keys service).
RUN useradd --create-home --uid 1000 kiln \
    && mkdir -p /var/lib/kiln/store /var/cache/kiln/inductor /var/cache/kiln/triton /var/cache/kiln/huggingface \
        /etc/kiln/keys /etc/kiln/signing \
    && chmod 700 /etc/kiln/signing \
    && chown -R kiln:kiln /var/lib/kiln /var/cache/kiln /etc/kiln

WORKDIR /opt/kiln

# Dependencies in their own layer, so editing Kiln's code does not reinstall them. The base's torch satisfies
# torch>=2.11, so pip keeps it rather than pulling another multi-GB build.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && python -m pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .
RUN python -m pip install --no-deps . && python -c "import torch, kiln_cli; print('torch', torch.__version__)"

USER kiln
WORKDIR /home/kiln
VOLUME ["/var/lib/kiln/store", "/var/cache/kiln", "/etc/kiln/keys", "/etc/kiln/signing"]
# 50051: compile service; 50052: execute service (gRPC, with health and reflection).
EXPOSE 50051 50052
CMD ["kiln", "--help"]
