"""The gateway's side of its upstreams: backend pools and routing (``pools``), active health checks
and model discovery (``health``), and the shared aiohttp client with a proxy's header rules
(``client``). Only the gateway uses these; the inference backend itself lives in ``backends``.
"""
