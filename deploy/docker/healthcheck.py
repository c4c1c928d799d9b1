#!/opt/venv/bin/python
"""The images' HEALTHCHECK: GET $TOKENGATE_HEALTHCHECK_URL (the gateway's /healthz, the reference
backend's /health); exit 0 on a 2xx within 2 s, else 1. No curl in the image: the venv's Python."""

from __future__ import annotations

import os
import sys
import urllib.request

url = os.environ.get("TOKENGATE_HEALTHCHECK_URL", "http://127.0.0.1:8080/healthz")
if len(sys.argv) > 1:
    url = sys.argv[1]
try:
    with urllib.request.urlopen(url, timeout=2) as r:
        sys.exit(0 if 200 <= r.status < 300 else 1)
except Exception as exc:
    print(f"unhealthy: {url}: {exc}", file=sys.stderr)
    sys.exit(1)
