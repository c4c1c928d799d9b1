"""What the gateway's HTTP server tells the app about one request without a ``receive()`` call.

ASGI only offers ``receive()``: an app learns that its body is complete by reading it, and that its
client hung up by having a task wait on ``receive()`` for ``http.disconnect``. Both cost every
request a timer (the body deadline is armed even when the body came with the headers) and a task
(the disconnect watcher, woken and cancelled once per request). The gateway's own protocol
(``gateway.process.http_server``) knows both facts as they happen, so it puts a ``RequestSignals`` into
the request's ``scope["extensions"]`` under ``SIGNALS``:

* ``body_complete``: the whole body has been parsed (set before the app runs for a body that
  arrived with its headers), so the first ``receive()`` returns it without waiting;
* ``on_disconnect``: the app sets a callback; the protocol calls it once when the connection is
  lost;
* ``connection``: the `Connection` the request came on, one per client connection, which the app
  marks with the tenant using it (gateway.request.tenant_connections) and the protocol closes when it goes;
* ``forwarder``: set by a front end that forwards the admitted request itself (Envoy, through
  tokengate's external processor: gateway.extproc): the proxy hands it the request as it would send
  it, instead of sending it with its own client (``gateway.request.exchange.Forwarder``).

Under any other ASGI server the key is absent and the app falls back to the timer and the task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

SIGNALS = "tokengate.request_signals"

_NO_EXTENSIONS: Mapping[str, Any] = {}


class Connection:
    """One client connection, as the app sees it: which tenant uses it, and what to call once it
    is closed (set by the app, run by the protocol at most once)."""

    __slots__ = ("gone", "on_close", "owner")

    def __init__(self) -> None:
        self.owner: str | None = None
        self.on_close: Callable[[Connection], None] | None = None
        self.gone = False  # closed already: a request still running on it claims nothing

    def closed(self) -> None:
        self.gone = True
        callback, self.on_close = self.on_close, None
        if callback is not None:
            callback(self)


class RequestSignals:
    """One request's signals; written by the protocol, read (and ``on_disconnect`` set) by the app."""

    __slots__ = ("body_complete", "connection", "forwarder", "on_disconnect")

    def __init__(self, connection: Connection | None = None, forwarder: Any = None) -> None:
        self.body_complete = False
        self.on_disconnect: Callable[[], None] | None = None
        self.connection = connection
        self.forwarder = forwarder  # a gateway.request.exchange.Forwarder, or None: the proxy sends it

    def disconnected(self) -> None:
        """Called by the protocol when the connection is lost; runs the app's callback at most once."""
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None:
            callback()


def request_signals(scope: Mapping[str, Any]) -> RequestSignals | None:
    """The request's signals, or None when the server is not the gateway's own."""
    found = (scope.get("extensions") or _NO_EXTENSIONS).get(SIGNALS)
    return found if isinstance(found, RequestSignals) else None
