"""``tokengate extproc``: Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor`` as a gRPC server
(``grpc.aio``) in the gateway's own process and event loop.

Each ``Process`` stream is one HTTP request through Envoy, handled by ``EnvoyStream`` as an ASGI
request to the gateway's app: one admission core for the proxy and the processor. The server needs
no generated service code: the one method is registered by its path, with the message types of
``wire.proto``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from gateway.config.schema import ExtprocConfig
from gateway.extproc import messages
from gateway.extproc.stream import App, EnvoyStream
from gateway.extproc.wire_pb2 import ProcessingRequest, ProcessingResponse

log = logging.getLogger("tokengate.extproc")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METHOD = "Process"


class ExtprocServer:
    """The gRPC listener Envoy's ext_proc filter calls; started and stopped with the gateway."""

    def __init__(self, settings: ExtprocConfig, app: App, max_body_bytes: int) -> None:
        self.settings = settings
        self.app = app
        # As much as Envoy buffers: a body past limits.max_body_bytes reaches the gateway's 413.
        self.max_message = settings.message_limit(max_body_bytes)
        self.port = 0  # bound, once started
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message),
                ("grpc.max_send_message_length", self.max_message),
                ("grpc.so_reuseport", 0),  # a busy port is an error, not a second listener
            ]
        )
        handler = grpc.stream_stream_rpc_method_handler(
            self._process,
            request_deserializer=ProcessingRequest.FromString,
            response_serializer=ProcessingResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
        address = f"{self.settings.host}:{self.settings.port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"extproc: cannot listen on {address} (extproc.host/port): {exc}") from None
        await server.start()
        self._server = server
        log.info("ext_proc listening on %s:%d", self.settings.host, self.port)

    async def stop(self, grace_s: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)

    async def _process(self, requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        first = await anext(aiter(requests), None)
        if first is None:
            return
        if first.WhichOneof("request") != "request_headers":
            # A filter that sends no request headers (configured for responses only) asks nothing
            # tokengate decides: every message passes unchanged.
            await context.write(messages.continue_for(first.WhichOneof("request")))
            async for msg in requests:
                await context.write(messages.continue_for(msg.WhichOneof("request")))
            return
        stream = EnvoyStream(self.settings, context.write, requests)
        await stream.run(self.app, first.request_headers)


__all__ = ["METHOD", "SERVICE", "ExtprocServer"]
