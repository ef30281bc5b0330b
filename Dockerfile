# CPU image: the deepinfer-gateway serving the OpenAI API on the reference engine (no GPU, no downloads at run time).
#   docker build -t deepinfer-gateway:0.1.0 .
#   docker run --rm -p 8000:8000 deepinfer-gateway:0.1.0
# The default config is /etc/deepinfer-gateway/config.yaml (deploy/config/reference.yaml); mount another file there,
# or override single keys with GATEWAY_* variables (e.g. -e GATEWAY_SERVER__RUNTIME__LOG_LEVEL=debug).
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEEPINFER_GATEWAY_CACHE=/var/cache/deepinfer-gateway

# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can check it and volumes can be chowned to it.
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --create-home --home-dir /home/gateway --shell /usr/sbin/nologin gateway \
    && mkdir -p "$DEEPINFER_GATEWAY_CACHE" \
    && chown gateway:gateway "$DEEPINFER_GATEWAY_CACHE"

WORKDIR /build
COPY pyproject.toml README.md ./
# .dockerignore leaves out src/loadgen (the `bench` load generator): the image serves, it does not benchmark.
COPY src ./src
RUN pip install --no-cache-dir . \
    && rm -rf /build

COPY deploy/config/reference.yaml /etc/deepinfer-gateway/config.yaml

USER 10001:10001
WORKDIR /home/gateway

# Build the reference tokenizer and n-gram model now, as the runtime user, so a container is ready in about a second
# instead of 10-20 s. The cache is keyed by the Python version, the stdlib and the installed build code, all of
# which are fixed in this image, so the run-time engine loads these files and never writes the cache.
RUN python -c "from backends.reference.artifacts import load_or_build; print(load_or_build().path)"

EXPOSE 8000

# /health is liveness only (the process serves HTTP); use /ready to know the backends are up.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]

CMD ["deepinfer-gateway", "serve", "--config", "/etc/deepinfer-gateway/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
