"""The ``observability`` section of the config file: windows, HOL, shape, scraping and per-class SLOs.

Every key is optional. The gateway's config loader hands the raw mapping to
:meth:`ObserveSettings.from_dict`; errors name the field the way the rest of the config does
(``observability.scrape.interval_s: expected a positive number, got -1``)::

    observability:
      window_s: 10            # one rolling window
      windows: 30             # windows kept (history shown by /stats and the dashboard)
      hol: {lookback_windows: 12, min_windows: 6, threshold: 0.7, min_swing: 2, min_swing_s: 0.05}
      shape: {window_requests: 2000, split_at: 10, two_services_at: 50, min_requests: 50}
      scrape: {interval_s: 5, timeout_s: 2, stale_after_s: 15, kv_threshold: 0.95, kv_soft: 0.8,
               thrash_preemptions_per_s: 1.0}
      slos:                   # per request class; either key may be left out
        short: {ttft_p99_s: 1.0, queue_wait_p99_s: 0.5}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config.fields import (
    ConfigError,
    integer,
    mapping,
    number,
    opt_positive_number,
    positive_number,
    section,
)

# Kept as a name for callers; errors are the config toolkit's, naming the field by its path.
ObserveConfigError = ConfigError


@dataclass(frozen=True, slots=True)
class HolSettings:
    lookback_windows: int = 12
    # Fewer windows than this and a correlation is noise: report none.
    min_windows: int = 6
    threshold: float = 0.7
    # The victim's largest window p99 must be at least this many times its smallest one: a class
    # whose p99 only jitters is not being blocked, whatever its jitter happens to correlate with.
    min_swing: float = 2.0
    # ... and at least this many seconds above it: 15 ms -> 30 ms is a 2x swing and still noise.
    # A long prefill that blocks a short class stalls it for hundreds of milliseconds.
    min_swing_s: float = 0.05


@dataclass(frozen=True, slots=True)
class ShapeSettings:
    window_requests: int = 2000
    split_at: float = 10.0
    two_services_at: float = 50.0
    # Below this many requests in the window the ratio is not trusted enough to advise.
    min_requests: int = 50


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    interval_s: float = 5.0
    timeout_s: float = 2.0
    stale_after_s: float = 15.0
    kv_threshold: float = 0.95
    kv_soft: float = 0.80
    thrash_preemptions_per_s: float = 1.0


@dataclass(frozen=True, slots=True)
class ClassSlo:
    ttft_p99_s: float | None = None
    queue_wait_p99_s: float | None = None


@dataclass(frozen=True, slots=True)
class ObserveSettings:
    window_s: float = 10.0
    windows: int = 30
    hol: HolSettings = field(default_factory=HolSettings)
    shape: ShapeSettings = field(default_factory=ShapeSettings)
    scrape: ScrapeSettings = field(default_factory=ScrapeSettings)
    slos: Mapping[str, ClassSlo] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, where: str = "observability") -> ObserveSettings:
        if raw is None:
            return cls()
        d = section(raw, where, ("window_s", "windows", "hol", "shape", "scrape", "slos"))
        w = f"{where}.hol"
        h = section(
            d.get("hol"), w, ("lookback_windows", "min_windows", "threshold", "min_swing", "min_swing_s")
        )
        hd = HolSettings()
        hol = HolSettings(
            lookback_windows=integer(h, "lookback_windows", w, hd.lookback_windows, minimum=2),
            min_windows=integer(h, "min_windows", w, hd.min_windows, minimum=2),
            threshold=positive_number(h, "threshold", w, hd.threshold, maximum=1.0),
            min_swing=positive_number(h, "min_swing", w, hd.min_swing),
            min_swing_s=number(h, "min_swing_s", w, hd.min_swing_s, minimum=0.0),
        )
        if hol.min_windows > hol.lookback_windows:
            raise ConfigError(
                f"{w}.min_windows: must be <= lookback_windows ({hol.lookback_windows}), got {hol.min_windows}"
            )
        w = f"{where}.shape"
        sh = section(d.get("shape"), w, ("window_requests", "split_at", "two_services_at", "min_requests"))
        sd = ShapeSettings()
        shape = ShapeSettings(
            window_requests=integer(sh, "window_requests", w, sd.window_requests, minimum=2),
            split_at=positive_number(sh, "split_at", w, sd.split_at),
            two_services_at=positive_number(sh, "two_services_at", w, sd.two_services_at),
            min_requests=integer(sh, "min_requests", w, sd.min_requests, minimum=1),
        )
        if shape.two_services_at < shape.split_at:
            raise ConfigError(
                f"{w}.two_services_at: must be >= split_at ({shape.split_at:g}), got {shape.two_services_at:g}"
            )
        w = f"{where}.scrape"
        keys = (
            "interval_s",
            "timeout_s",
            "stale_after_s",
            "kv_threshold",
            "kv_soft",
            "thrash_preemptions_per_s",
        )
        sc = section(d.get("scrape"), w, keys)
        cd = ScrapeSettings()
        scrape = ScrapeSettings(
            interval_s=positive_number(sc, "interval_s", w, cd.interval_s),
            timeout_s=positive_number(sc, "timeout_s", w, cd.timeout_s),
            stale_after_s=positive_number(sc, "stale_after_s", w, cd.stale_after_s),
            kv_threshold=positive_number(sc, "kv_threshold", w, cd.kv_threshold, maximum=1.0),
            kv_soft=positive_number(sc, "kv_soft", w, cd.kv_soft, maximum=1.0),
            thrash_preemptions_per_s=positive_number(
                sc, "thrash_preemptions_per_s", w, cd.thrash_preemptions_per_s
            ),
        )
        if scrape.kv_soft > scrape.kv_threshold:
            raise ConfigError(
                f"{w}.kv_soft: must be <= kv_threshold ({scrape.kv_threshold:g}), got {scrape.kv_soft:g}"
            )
        slos: dict[str, ClassSlo] = {}
        for name, slo_raw in mapping(d.get("slos", {}), f"{where}.slos").items():
            w = f"{where}.slos.{name}"
            s = section(slo_raw, w, ("ttft_p99_s", "queue_wait_p99_s"))
            slos[str(name)] = ClassSlo(
                ttft_p99_s=opt_positive_number(s, "ttft_p99_s", w),
                queue_wait_p99_s=opt_positive_number(s, "queue_wait_p99_s", w),
            )
        return cls(
            window_s=positive_number(d, "window_s", where, 10.0),
            windows=integer(d, "windows", where, 30, minimum=2),
            hol=hol,
            shape=shape,
            scrape=scrape,
            slos=slos,
        )
