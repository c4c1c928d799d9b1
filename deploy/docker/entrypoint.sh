#!/bin/sh
# The images' entrypoint: `tokengate "$@"`, exec'd so tokengate is PID 1 and receives SIGTERM
# itself (the gateway drains before it exits).
#
# With TOKENGATE_CONFIG_TEMPLATE set, the file it names is rendered first into
# TOKENGATE_CONFIG_RENDERED (default /tmp/tokengate/config.yaml): every ${NAME} in it is replaced
# by the environment variable NAME, quoted as a YAML string (Kubernetes: the Redis URL and backend
# API keys come from a Secret; see deploy/k8s). Pass the rendered path to `serve --config`.
set -eu
if [ -n "${TOKENGATE_CONFIG_TEMPLATE:-}" ]; then
  tokengate-render-config "$TOKENGATE_CONFIG_TEMPLATE" "${TOKENGATE_CONFIG_RENDERED:-/tmp/tokengate/config.yaml}"
fi
exec tokengate "$@"
