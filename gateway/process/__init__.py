"""The gateway as a process: ``tokengate serve`` (``serve``: the API and ops listeners, SIGHUP, workers),
the HTTP server's guards and the signals it gives the app (``http_server``, ``signals``), the embedded
reference backend (``embedded``) and log formatting (``logs``).
"""
