"""Request-class observability: backend load scraping, the head-of-line fingerprint, pool shape
and split advice, ``/stats`` + ``/insights`` + ``/dashboard``.

The gateway creates one :class:`Observer`, calls its cheap hook on the request path, registers
its collectors in the app's CollectorRegistry and mounts :func:`observe_routes`.
"""

from gateway.observe.observer import Observer
from gateway.observe.scrape import BackendLoad, BackendLoads, ScrapeTarget
from gateway.observe.settings import ObserveConfigError, ObserveSettings
from gateway.observe.stats import ConfigView, ReservationSources, StatsSources, observe_routes

__all__ = [
    "BackendLoad",
    "BackendLoads",
    "ConfigView",
    "ObserveConfigError",
    "ObserveSettings",
    "Observer",
    "ReservationSources",
    "ScrapeTarget",
    "StatsSources",
    "observe_routes",
]
