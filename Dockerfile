# syntax=docker/dockerfile:1
# tokengate images (docs/operations.md "Images"):
#   docker build -t tokengate .                          the gateway (default target; no torch)
#   docker build --target reference -t tokengate-reference .
#                                                        + torch: the reference backend's torch executor
#   CUDA: --build-arg TORCH_SPEC=torch==2.13.0+cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Both run as an unprivileged user (uid 10001), exec tokengate as PID 1 so SIGTERM reaches it
# (the gateway drains: new requests 503, in-flight ones finish up to drain_timeout_s), and carry
# a HEALTHCHECK. Debian's python3 on debian:bookworm-slim, so every stage shares one interpreter.
ARG BASE_IMAGE=debian:bookworm-slim

# ---- build: a venv with the project's dependencies, then the project itself ----
FROM ${BASE_IMAGE} AS build
# Marks every stage's images: those a rebuild leaves dangling are pruned by the compose test.
LABEL org.tokengate.project=tokengate
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# pip trusts the system's CA store (what ca-certificates built, a local proxy CA included).
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first (from pyproject.toml alone), so a code change does not reinstall them.
COPY pyproject.toml ./
# (with the otel and extproc extras: tracing over OTLP/gRPC and `tokengate extproc` work in the image)
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml','rb'))['project']; x = p['optional-dependencies']; print('\n'.join(p['dependencies'] + x['otel'] + x['extproc']))" > /tmp/requirements.txt \
 && pip install -q -r /tmp/requirements.txt
COPY README.md ./
COPY gateway ./gateway
COPY budgets ./budgets
COPY classifiers ./classifiers
COPY backends ./backends
COPY loadtest ./loadtest
RUN pip install -q --no-deps .

# ---- the runtime every target shares: python3, the venv, the user, entrypoint and health check ----
FROM ${BASE_IMAGE} AS runtime
LABEL org.tokengate.project=tokengate
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tokengate \
 && useradd --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin tokengate
COPY deploy/docker/entrypoint.sh /usr/local/bin/tokengate-entrypoint
COPY deploy/docker/render_config.py /usr/local/bin/tokengate-render-config
COPY deploy/docker/healthcheck.py /usr/local/bin/tokengate-healthcheck
COPY deploy/docker/config.yaml /etc/tokengate/config.yaml
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["tokengate-entrypoint"]

# ---- reference: the reference backend with torch (CPU wheel by default) ----
FROM build AS reference-build
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A local folder of wheels to use instead (podman build -v DIR:/wheels:ro --build-arg TORCH_FIND_LINKS=/wheels).
ARG TORCH_FIND_LINKS=
RUN if [ -n "$TORCH_FIND_LINKS" ]; then \
      pip install -q --find-links "$TORCH_FIND_LINKS" "$TORCH_SPEC"; \
    else \
      pip install -q --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple "$TORCH_SPEC"; \
    fi \
 && pip install -q 'safetensors>=0.4' 'numpy>=1.26'

FROM runtime AS reference
COPY --from=reference-build /opt/venv /opt/venv
ENV TOKENGATE_HEALTHCHECK_URL=http://127.0.0.1:8000/health
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 CMD ["tokengate-healthcheck"]
CMD ["backend", "--host", "0.0.0.0", "--port", "8000", "--executor", "torch"]

# ---- gateway (the default target): no torch; also runs the reference backend's sim executor ----
FROM runtime AS gateway
COPY --from=build /opt/venv /opt/venv
ENV TOKENGATE_HEALTHCHECK_URL=http://127.0.0.1:8080/healthz
# 8080: the API (/v1, /healthz, /readyz); 9091: the ops listener (/metrics /stats /insights /dashboard /admin)
EXPOSE 8080 9091
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 CMD ["tokengate-healthcheck"]
CMD ["serve", "--config", "/etc/tokengate/config.yaml"]
