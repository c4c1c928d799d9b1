"""The stack ``python -m loadtest.fuzz --spawn`` fuzzes: an answer-at-once stub backend in this process
and ``tokengate serve`` as a child process in front of it, with short body/header deadlines so that
lying framing is answered well inside the fuzzer's hang limit; its budgets in memory, or with
``store="redis"`` in a redis-server of its own (the Lua port gets the same hostile requests)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import yaml

from loadtest.processes import ProcessGroup, free_port, wait_ready
from loadtest.redis_server import RedisServer
from loadtest.stack import gateway_command
from loadtest.stub_backend import StubBackend, StubConfig

ADMIN_TOKEN = "fuzz-admin-token"


@asynccontextmanager
async def fuzz_stack(work_dir: Path | None = None, store: str = "memory") -> AsyncIterator[tuple[str, str]]:
    """Yields the gateway's API and ops base URLs; everything is stopped on exit."""
    redis = RedisServer().start() if store == "redis" else None
    stub = await StubBackend(
        StubConfig(first_token_delay_s=0.0, inter_token_delay_s=0.0, model="stub-model", max_output=256)
    ).start()
    tmp = tempfile.TemporaryDirectory(prefix="tokengate-fuzz-") if work_dir is None else None
    root = Path(tmp.name) if tmp is not None else work_dir
    assert root is not None
    port, ops_port = free_port(), free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "ops": {"port": ops_port},
        "pools": {
            "default": {"backends": [{"url": stub.url, "capacity_tokens": 200_000, "models": ["stub-model"]}]}
        },
        "limits": {"body_timeout_s": 3, "header_timeout_s": 3},
        # images priced by their size (classifiers/images.py): the fuzzer sends broken ones
        "models": {
            "stub-*": {
                "context_length": 65536,
                "images": {"patch_pixels": 28, "max_pixels": 1_003_520},
                "vocab_size": 32_000,  # token ids checked against it (classifiers/pricing/validation.py)
            }
        },
        # a pass-through route: its JSON bodies are checked too (engine fields, media URLs, encodings)
        "passthrough": {"routes": [{"method": "POST", "path": "/v1/rerank", "generates": False}]},
        "drain_timeout_s": 2,
        "admin": {"tokens_file": str(root / "tokens")},
    }
    if redis is not None:
        config["store"] = {"kind": "redis", "url": redis.url}
    (root / "tokens").write_text(f"admin {ADMIN_TOKEN}\n")
    path = root / "fuzz-gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    group = ProcessGroup()
    try:
        child = group.start("gateway", gateway_command(path), root / "gateway.log")
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_ready, [(child, [f"{url}/readyz"])], 60.0)
        yield url, f"http://127.0.0.1:{ops_port}"
        if child.exited() is not None:
            raise RuntimeError(f"the gateway died during the fuzz run:\n{child.log_tail()}")
    finally:
        group.stop_all()
        await stub.close()
        if redis is not None:
            redis.stop()
        if tmp is not None:
            tmp.cleanup()
