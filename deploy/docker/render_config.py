#!/opt/venv/bin/python
"""Render a tokengate config template: ``${NAME}`` -> the environment variable NAME.

Each placeholder must be a whole YAML value (``url: ${TOKENGATE_REDIS_URL}``); it is replaced by
the value as a JSON string, which YAML reads as a double-quoted string, so a password with ``:``,
``#`` or quotes cannot change the file's structure. An unset variable is an error naming it (a
gateway started against the wrong Redis is worse than one that does not start).

Usage: tokengate-render-config TEMPLATE OUT
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def render(text: str, env: dict[str, str]) -> str:
    missing = sorted({m.group(1) for m in PLACEHOLDER.finditer(text) if m.group(1) not in env})
    if missing:
        raise KeyError(", ".join(missing))
    return PLACEHOLDER.sub(lambda m: json.dumps(env[m.group(1)]), text)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src, out = Path(argv[1]), Path(argv[2])
    try:
        rendered = render(src.read_text(encoding="utf-8"), dict(os.environ))
    except KeyError as exc:
        print(
            f"tokengate-render-config: {src}: environment variable(s) not set: {exc.args[0]}", file=sys.stderr
        )
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(rendered, encoding="utf-8")
    os.chmod(out, 0o600)  # it may hold the Redis password
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
