"""The ``observability`` section of the config file: windows, HOL, shape, scraping and per-class SLOs.

Every key is optional. The gateway's config loader hands the raw mapping to
:meth:`ObserveSettings.from_dict`; errors name the field the way the rest of the config does
(``observability.scrape.interval_s: expected a positive number, got -1``)::

    observability:
      window_s: 10            # one rolling window
      windows: 30             # windows kept (history shown by /stats and the dashboard)
      hol: {lookback_windows: 12, min_windows: 6, threshold: 0.7, min_swing: 2}
      shape: {window_requests: 2000, split_at: 10, two_services_at: 50, min_requests: 50}
      scrape: {interval_s: 5, timeout_s: 2, stale_after_s: 15, kv_threshold: 0.95, kv_soft: 0.8,
               thrash_preemptions_per_s: 1.0}
      slos:                   # per request class; either key may be left out
        short: {ttft_p99_s: 1.0, queue_wait_p99_s: 0.5}
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ObserveConfigError(ValueError):
    """A bad ``observability`` value; the message starts with the field's dotted path."""


@dataclass(frozen=True, slots=True)
class HolSettings:
    lookback_windows: int = 12
    # Fewer windows than this and a correlation is noise: report none.
    min_windows: int = 6
    threshold: float = 0.7
    # The victim's largest window p99 must be at least this many times its smallest one: a class
    # whose p99 only jitters is not being blocked, whatever its jitter happens to correlate with.
    min_swing: float = 2.0


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
        d = _mapping(raw, where)
        _no_unknown(d, ("window_s", "windows", "hol", "shape", "scrape", "slos"), where)
        hol_raw = _mapping(d.get("hol", {}), f"{where}.hol")
        _no_unknown(hol_raw, ("lookback_windows", "min_windows", "threshold", "min_swing"), f"{where}.hol")
        shape_raw = _mapping(d.get("shape", {}), f"{where}.shape")
        _no_unknown(
            shape_raw, ("window_requests", "split_at", "two_services_at", "min_requests"), f"{where}.shape"
        )
        scrape_raw = _mapping(d.get("scrape", {}), f"{where}.scrape")
        _no_unknown(
            scrape_raw,
            (
                "interval_s",
                "timeout_s",
                "stale_after_s",
                "kv_threshold",
                "kv_soft",
                "thrash_preemptions_per_s",
            ),
            f"{where}.scrape",
        )
        hd, sd, cd = HolSettings(), ShapeSettings(), ScrapeSettings()
        hol = HolSettings(
            lookback_windows=_int(hol_raw, "lookback_windows", hd.lookback_windows, f"{where}.hol", 2),
            min_windows=_int(hol_raw, "min_windows", hd.min_windows, f"{where}.hol", 2),
            threshold=_num(hol_raw, "threshold", hd.threshold, f"{where}.hol", upper=1.0),
            min_swing=_num(hol_raw, "min_swing", hd.min_swing, f"{where}.hol"),
        )
        if hol.min_windows > hol.lookback_windows:
            raise ObserveConfigError(
                f"{where}.hol.min_windows: must be <= lookback_windows ({hol.lookback_windows}), "
                f"got {hol.min_windows}"
            )
        shape = ShapeSettings(
            window_requests=_int(shape_raw, "window_requests", sd.window_requests, f"{where}.shape", 2),
            split_at=_num(shape_raw, "split_at", sd.split_at, f"{where}.shape"),
            two_services_at=_num(shape_raw, "two_services_at", sd.two_services_at, f"{where}.shape"),
            min_requests=_int(shape_raw, "min_requests", sd.min_requests, f"{where}.shape", 1),
        )
        if shape.two_services_at < shape.split_at:
            raise ObserveConfigError(
                f"{where}.shape.two_services_at: must be >= split_at ({shape.split_at:g}), "
                f"got {shape.two_services_at:g}"
            )
        w = f"{where}.scrape"
        scrape = ScrapeSettings(
            interval_s=_num(scrape_raw, "interval_s", cd.interval_s, w),
            timeout_s=_num(scrape_raw, "timeout_s", cd.timeout_s, w),
            stale_after_s=_num(scrape_raw, "stale_after_s", cd.stale_after_s, w),
            kv_threshold=_num(scrape_raw, "kv_threshold", cd.kv_threshold, w, upper=1.0),
            kv_soft=_num(scrape_raw, "kv_soft", cd.kv_soft, w, upper=1.0),
            thrash_preemptions_per_s=_num(
                scrape_raw, "thrash_preemptions_per_s", cd.thrash_preemptions_per_s, w
            ),
        )
        if scrape.kv_soft > scrape.kv_threshold:
            raise ObserveConfigError(
                f"{w}.kv_soft: must be <= kv_threshold ({scrape.kv_threshold:g}), got {scrape.kv_soft:g}"
            )
        slos_raw = _mapping(d.get("slos", {}), f"{where}.slos")
        slos: dict[str, ClassSlo] = {}
        for name, slo_raw in slos_raw.items():
            sw = f"{where}.slos.{name}"
            s = _mapping(slo_raw, sw)
            _no_unknown(s, ("ttft_p99_s", "queue_wait_p99_s"), sw)
            slos[str(name)] = ClassSlo(
                ttft_p99_s=_num(s, "ttft_p99_s", None, sw),
                queue_wait_p99_s=_num(s, "queue_wait_p99_s", None, sw),
            )
        return cls(
            window_s=_num(d, "window_s", 10.0, where),
            windows=_int(d, "windows", 30, where, 2),
            hol=hol,
            shape=shape,
            scrape=scrape,
            slos=slos,
        )


def _mapping(v: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ObserveConfigError(f"{where}: expected a mapping, got {type(v).__name__}")
    return v


def _no_unknown(d: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for k in d:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
            raise ObserveConfigError(f"{where}.{k}: unknown key{hint}")


def _num(d: Mapping[str, Any], key: str, default: Any, where: str, upper: float | None = None) -> Any:
    if key not in d:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0 or (upper is not None and v > upper):
        rng = f"a number in (0, {upper:g}]" if upper is not None else "a positive number"
        raise ObserveConfigError(f"{where}.{key}: expected {rng}, got {v!r}")
    return float(v)


def _int(d: Mapping[str, Any], key: str, default: int, where: str, minimum: int) -> int:
    if key not in d:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ObserveConfigError(f"{where}.{key}: expected an integer >= {minimum}, got {v!r}")
    return v
