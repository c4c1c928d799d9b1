"""The request path: one ``Exchange`` per request (``exchange``) and the ``Proxy`` that runs its steps
(``proxy``): authenticate (``auth``, ``tenant_connections``), read (``held_bodies``), price and reserve
(``reservations``, ``slots``, ``server_tools``, ``media_fetch``), admit and keep the lease alive
(``leases``), and what it reports (``usage``, ``errors``, ``requestid``, ``cache_salt``). What reaches it
at all: ``paths`` and ``passthrough``.
"""
