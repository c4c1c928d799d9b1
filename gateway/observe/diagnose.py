"""Plain-words findings from a ``/stats`` document: what is wrong and what to change.

Pure functions over the JSON (a dict), so the server (``/stats`` "findings", the dashboard) and
``tokengate doctor`` (reading a remote gateway) say exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LEVELS = ("ok", "info", "warn", "crit")


@dataclass(frozen=True, slots=True)
class Finding:
    level: str  # ok | info | warn | crit
    topic: str  # slo | hol | backend | one_server | gate | kv | slots | split | queue | store | bodies | connections | encode | pricing | shadow | quota
    text: str

    def as_dict(self) -> dict[str, str]:
        return {"level": self.level, "topic": self.topic, "text": self.text}


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 0.01:
        return f"{v * 1000:.1f} ms"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def diagnose(stats: Mapping[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    out += _store(stats)
    out += _slos(stats)
    out += _hol(stats)
    out += _one_server(stats)
    out += _gates(stats)
    out += _backends(stats)
    out += _usage(stats)
    out += _pools(stats)
    out += _split(stats)
    out += _bodies(stats)
    out += _connections(stats)
    out += _encode(stats)
    out += _pricing(stats)
    out += _shadow(stats)
    out += _quotas(stats)
    out.sort(key=lambda f: -LEVELS.index(f.level))
    return out


def _shadow(stats: Mapping[str, Any]) -> list[Finding]:
    """One line: the limits in shadow mode and what they would have refused (since this replica
    started), those that would have refused first."""
    shadow = (stats.get("limits") or {}).get("shadow") or []
    if not shadow:
        return []
    rows = sorted(
        shadow, key=lambda r: (-int(r.get("would_refuse") or 0), str(r.get("kind")), str(r.get("name")))
    )
    hits = sum(int(r.get("would_refuse") or 0) for r in rows)
    parts = [f"{r['kind']} {r['name']} {int(r.get('would_refuse') or 0):,}" for r in rows[:6]]
    more = f", {len(rows) - 6} more" if len(rows) > 6 else ""
    text = (
        f"{len(rows)} limit{'s' if len(rows) != 1 else ''} in shadow mode (enforce: false) would have refused "
        f"{hits:,} request{'s' if hits != 1 else ''} here: {'; '.join(parts)}{more}. Enforce one by setting "
        "enforce (budget_enforce, ceiling_enforce) to true."
    )
    return [Finding("info", "shadow", text)]


def _quotas(stats: Mapping[str, Any]) -> list[Finding]:
    """Enforced quotas nine tenths used: their tenants' requests are about to get 429s."""
    out = []
    for r in (stats.get("limits") or {}).get("quotas") or []:
        limit = r.get("limit") or 0
        held = (r.get("used") or 0) + (r.get("reserved") or 0)
        if not r.get("enforce", True) or not limit or held < 0.9 * limit:
            continue
        full = held >= limit
        unit = r.get("unit")

        def n(v: float, unit: object = unit) -> str:
            return f"{v:,.2f}" if unit == "cost" else f"{int(v):,}"

        window = f"{'rolling ' if r.get('rolling') else ''}{r.get('window')}"
        out.append(
            Finding(
                "warn" if full else "info",
                "quota",
                f"quota {r['name']} of tenant {r['tenant']} is {min(held / limit, 1.0):.0%} used "
                f"({n(held)} of {n(limit)} {unit} per {window}): {'its' if full else 'soon its'} requests get "
                "429 quota_exceeded until the window frees room. Raise it with the admin API if that is not meant.",
            )
        )
    return out


def _store(stats: Mapping[str, Any]) -> list[Finding]:
    err = stats.get("store_error")
    if not err:
        return []
    return [
        Finding(
            "crit",
            "store",
            f"the budget store is not answering ({err}): admissions fail closed (503) or fall back to "
            "the local budget, depending on store.fail_mode. Check Redis.",
        )
    ]


def _bodies(stats: Mapping[str, Any]) -> list[Finding]:
    held = stats.get("held_bodies")
    if not held or not held.get("limit") or held["bytes"] < 0.8 * held["limit"]:
        return []
    top = held.get("top_tenants") or []
    who = f"; most of it {top[0]['tenant']}'s ({top[0]['bytes']:,} bytes)" if top else ""
    level = "crit" if held["bytes"] >= held["limit"] else "warn"
    return [
        Finding(
            level,
            "bodies",
            f"request bodies held in this process: {held['bytes']:,} of {held['limit']:,} bytes "
            f"(limits.max_held_body_bytes){who}. At the limit new requests get 503 overloaded; a "
            "tenant at its share (limits.max_held_body_bytes_per_tenant) gets 429. Large or slow "
            "uploads are held: raise the limits only with the process's memory (~2.5x the bodies).",
        )
    ]


def _connections(stats: Mapping[str, Any]) -> list[Finding]:
    conns = stats.get("tenant_connections")
    most = conns.get("limit_per_tenant") if conns else None
    if not conns or not most:
        return []
    full = [t for t in conns.get("top_tenants") or [] if t["connections"] >= 0.8 * most]
    if not full:
        return []
    names = ", ".join(f"{t['tenant']} ({t['connections']:,})" for t in full)
    level = "crit" if full[0]["connections"] >= most else "warn"
    return [
        Finding(
            level,
            "connections",
            f"tenants near their share of this process's client connections ({most:,}, "
            f"limits.max_connections_per_tenant): {names}. At it, a request on one more connection "
            "gets 429 too_many_connections and that connection is closed: have such clients reuse "
            "connections (HTTP keep-alive, a bounded pool), or raise the share.",
        )
    ]


# Characters of long prompts waiting for a tokenizer thread worth a word: about a second of work
# for the default two threads.
_ENCODE_BACKLOG_WARN = 8_000_000


def _encode(stats: Mapping[str, Any]) -> list[Finding]:
    backlog = stats.get("encode_backlog")
    if not backlog or backlog.get("chars", 0) < _ENCODE_BACKLOG_WARN:
        return []
    top = backlog.get("top_tenants") or []
    who = f"; most of it {top[0]['tenant']}'s ({top[0]['chars']:,})" if top else ""
    return [
        Finding(
            "warn",
            "encode",
            f"{backlog['chars']:,} characters of long prompts wait for a tokenizer thread{who}. The "
            "threads are shared fairly among tenants, so a flood delays its own tenant's prompts "
            "first; if every tenant's long prompts wait, raise pricing.encode_threads (CPU cores "
            "permitting) or lower limits.max_body_bytes.",
        )
    ]


# A model's prompt prices are off when their mean absolute error is above both of these.
_PRICING_ERROR_SHARE = 0.2  # of the prompt the engine counts
_PRICING_ERROR_TOKENS = 8


def _pricing(stats: Mapping[str, Any]) -> list[Finding]:
    """Models whose prompt prices are far from what their engine counts (``/stats`` ``pricing``)."""
    pricing = stats.get("pricing")
    if not pricing:
        return []
    need = int(pricing.get("min_samples", 1))
    out = []
    for m in pricing.get("models") or []:
        if m.get("samples", 0) < need:
            continue
        prompt = float(m.get("mean_reported") or 0.0)

        def off(error: float, prompt: float = prompt) -> bool:
            return error > _PRICING_ERROR_TOKENS and error > _PRICING_ERROR_SHARE * prompt

        after, before = float(m.get("error_after") or 0.0), float(m.get("error_before") or 0.0)
        name = f"model {m['model']} ({m['route']})"
        key = f"models.{m.get('pattern') or m['model']}"
        applied, learned = int(m.get("applied_overhead") or 0), int(m.get("learned_overhead") or 0)
        configured = m.get("configured_overhead")
        templated = m["route"] in ("chat", "responses")
        if off(after):
            source = (
                "configured" if configured is not None else "learned" if m.get("learning") else "learning off"
            )
            if abs(learned - applied) * 2 < after:
                fix = (
                    "The difference varies from request to request, so no constant overhead corrects it: "
                    f"the pricing tokenizer is not the model's; set {key}.tokenizer to the model's own "
                    "(hf:<path>/tokenizer.json)."
                )
            elif templated and learned >= 0:
                fix = f"Set {key}.prompt_overhead_tokens: {learned}" + (
                    " (or remove it, and the gateway learns it)." if configured is not None else "."
                )
            elif configured is not None:
                fix = f"Remove {key}.prompt_overhead_tokens: the gateway then learns the difference ({learned:+d})."
            else:
                fix = f"Set {key}.learn_prompt_overhead: true to correct by the learned difference ({learned:+d})."
            out.append(
                Finding(
                    "warn",
                    "pricing",
                    f"{name}: prompt prices are off by {after:.0f} tokens a request on average "
                    f"({after / max(prompt, 1.0):.0%} of the {prompt:.0f} tokens the engine counts; priced "
                    f"{m.get('mean_priced', 0):.0f}, overhead applied {applied:+d} ({source}), over "
                    f"{m['samples']} requests). Admission trusts prices: too low admits more than the "
                    f"engine holds, too high leaves it idle. {fix}",
                )
            )
        elif off(before) and configured is None and applied:
            pin = (
                f": to keep it across restarts, set {key}.prompt_overhead_tokens: {learned}."
                if templated and learned > 0
                else "."
            )
            out.append(
                Finding(
                    "info",
                    "pricing",
                    f"{name}: the engine counts {learned:+d} tokens a prompt beyond the price"
                    f"{' (its chat template)' if templated else ''}; the learned overhead corrects it (mean error {before:.0f} -> {after:.0f} "
                    f"tokens). It is learned again after a restart{pin}",
                )
            )
    return out


def _slos(stats: Mapping[str, Any]) -> list[Finding]:
    out = []
    for c in stats.get("classes", []):
        slo = c.get("slo") or {}
        recent = c.get("recent") or {}
        for sig, key, words in (
            ("ttft", "ttft_p99_s", "p99 time to first token"),
            ("queue_wait", "queue_wait_p99_s", "p99 queue wait"),
        ):
            limit = slo.get(key)
            p99 = (recent.get(sig) or {}).get("p99")
            if limit is None or p99 is None:
                continue
            if p99 > limit:
                hint = (
                    "requests wait at the gateway: the class's pool or its tenants' budgets are full"
                    if sig == "queue_wait"
                    else "see the head-of-line and KV findings for the cause"
                )
                out.append(
                    Finding(
                        "crit",
                        "slo",
                        f"class {c['name']}: {words} {fmt_s(p99)} is over its SLO of {fmt_s(limit)} ({hint}).",
                    )
                )
    return out


def _hol(stats: Mapping[str, Any]) -> list[Finding]:
    hol = stats.get("hol") or {}
    thr = float(hol.get("threshold", 0.7))
    need = int(hol.get("min_windows", 6))
    pairs = hol.get("pairs") or []
    scored = [
        p
        for p in pairs
        if p.get("windows", 0) >= need and (p.get("r_p99") is not None or p.get("r_inflight") is not None)
    ]
    hot = [p for p in scored if float(p.get("correlation", 0.0)) >= thr]
    one_server = {(o["victim"], o["aggressor"]): o["pool"] for o in stats.get("one_server") or []}
    out = []
    for p in hot:
        pool = one_server.get((p["victim"], p["aggressor"]))
        cure = (
            f"Pool {pool} has one backend and cannot be split: apply the one-server recipe (engine chunk "
            "cap and priority, tier priority forwarded, prefill gate)."
            if pool is not None
            else f"Long prefills of {p['aggressor']} stall {p['victim']}'s decodes on a shared backend: route "
            f"class {p['aggressor']} to its own pool (GET /insights?format=yaml has the edit) or turn on "
            "chunked prefill on the backends."
        )
        out.append(
            Finding(
                "crit",
                "hol",
                f"head-of-line blocking: class {p['victim']}'s p99 TTFT follows class {p['aggressor']} "
                f"(r={p['correlation']:.2f} over {p['windows']} windows"
                + (
                    f"; now {fmt_s(p['victim_p99_ttft_s'])}). "
                    if p.get("victim_p99_ttft_s") is not None
                    else "). "
                )
                + cure,
            )
        )
    if not hot:
        if scored:
            best = max(scored, key=lambda p: float(p.get("correlation", 0.0)))
            out.append(
                Finding(
                    "ok",
                    "hol",
                    f"no head-of-line fingerprint (strongest: {best['victim']} vs {best['aggressor']}, "
                    f"r={best['correlation']:.2f} < {thr:.2f}).",
                )
            )
        else:
            out.append(
                Finding(
                    "info",
                    "hol",
                    f"head-of-line fingerprint: not enough data yet (needs {need} windows with traffic in "
                    "a short and a longer class).",
                )
            )
    return out


def _one_server(stats: Mapping[str, Any]) -> list[Finding]:
    """A one-backend pool with head-of-line blocking: the settings that make one server safe."""
    out = []
    for o in stats.get("one_server") or []:
        level = "warn" if o.get("all_in_effect") else "crit"
        text = str(o.get("text", ""))
        if o.get("all_in_effect"):
            text += " Every one of these is in effect: lower the chunk cap or the gate to tighten further."
        out.append(Finding(level, "one_server", text))
    return out


# A short prompt's wait at the prefill gate worth a word (p99): the reserve exists so that it is ~0.
GATE_SHORT_WAIT_WARN_S = 0.05
# A long prompt's wait at the gate worth a word (p99): one at a time, a stream of them queues.
GATE_LONG_WAIT_INFO_S = 10.0


def suggested_reserve(short: Mapping[str, Any], long: Mapping[str, Any] | None = None) -> int | None:
    """The reserve a gate's short prompts need: the largest, plus the short tokens that arrive while
    one is inside (its p99 time to first token, at most 1 s), and at least the most short tokens let
    in within one second (their burst); rounded up to thousands, and at most half the smallest long
    prompt (a prompt that fits in the reserve is short: long ones must stay well above it)."""
    biggest = short.get("max_tokens")
    if not biggest:
        return None
    burst = (short.get("tokens_per_s") or 0.0) * min(short.get("inside_p99_s") or 0.0, 1.0)
    need = int(-(-max(biggest + burst, short.get("burst_tokens_1s") or 0) // 1000) * 1000)
    smallest_long = (long or {}).get("min_tokens")
    if smallest_long:
        need = min(need, max(1000, smallest_long // 2 // 1000 * 1000))
    return need


def _gates(stats: Mapping[str, Any]) -> list[Finding]:
    """A prefill gate that holds short prompts (its reserve is too small for them), or whose long
    prompts wait long (the trade-off between them and the short class)."""
    out = []
    for g in stats.get("prefill_gates") or []:
        where = f"the prefill gate of backend {g['backend']} (pool {g['pool']})"
        short, long = g.get("short") or {}, g.get("long") or {}
        wait = short.get("wait_p99_s")
        if short.get("held") and wait is not None and wait > GATE_SHORT_WAIT_WARN_S:
            reserve, limit = int(g["reserve"]), int(g["limit"])
            want = max(suggested_reserve(short, long) or 0, reserve + 1000)
            out.append(
                Finding(
                    "warn",
                    "gate",
                    f"{where} holds short prompts: p99 wait {fmt_s(wait)} over the last short prompts "
                    f"({short['held']:,} of {short['requests']:,} waited). A short prompt (at most "
                    f"{reserve:,} tokens) waits only while the short prompts inside fill the reserve: "
                    f"raise prefill_gate_reserve_tokens from {reserve:,} to {want:,} (the largest short "
                    f"prompt, {short.get('max_tokens') or 0:,} tokens, plus the "
                    f"{short.get('tokens_per_s') or 0:,.0f} short tokens/s that arrive while one is "
                    f"inside; at least their burst, {short.get('burst_tokens_1s') or 0:,} tokens within "
                    f"one second) and prefill_gate_tokens from {limit:,} to {limit - reserve + want:,}, so "
                    "the long prompts' lane stays the same.",
                )
            )
        long_wait = long.get("wait_p99_s")
        if long_wait is not None and long_wait > GATE_LONG_WAIT_INFO_S:
            out.append(
                Finding(
                    "info",
                    "gate",
                    f"{where}: long prompts wait {fmt_s(long_wait)} at p99 there, prefilling one at a time "
                    f"in a lane of {int(g['limit']) - int(g['reserve']):,} tokens. That is the price of "
                    "the short class's TTFT: a lane of two long prompts shortens it and lets two long "
                    "prefills stall short prompts at once; a larger budget for their tenant does not "
                    "shorten it, a tighter one lengthens it.",
                )
            )
    return out


def _usage(stats: Mapping[str, Any]) -> list[Finding]:
    """Backends whose answers come without usage: their token counts are estimates."""
    out = []
    for b in stats.get("backends", []):
        missing, reported = b.get("usage_missing", 0), b.get("usage_reported", 0)
        if not missing:
            continue
        name = f"backend {b['backend']} (pool {b['pool']})"
        if not reported:
            text = (
                f"{name} never reports usage ({missing} answers): prompt tokens are the gateway's "
                "price and a stream's output its relayed events, marked usage_estimated in the access "
                "log. Fair share, learned reservations and the estimate-error metrics rest on "
                "estimates there; an engine that honours stream_options.include_usage (vLLM, SGLang) "
                "reports exact counts."
            )
        else:
            share = missing / (missing + reported)
            text = (
                f"{name} left {missing} of {missing + reported} answers ({share:.0%}) without usage: "
                "their token counts are estimated (usage_estimated in the access log)."
            )
        out.append(Finding("warn", "usage", text))
    return out


# A backend whose engine queues at least this many requests while its KV cache is below this is
# bounded by its sequence slots (a few waiting for a step are normal).
_SLOTS_BOUND_WAITING = 8
_SLOTS_BOUND_KV = 0.5


def _backends(stats: Mapping[str, Any]) -> list[Finding]:
    out = []
    for b in stats.get("backends", []):
        name = f"backend {b['backend']} (pool {b['pool']})"
        kv = b.get("kv_usage")
        health = b.get("health")
        if health == "down":
            out.append(
                Finding(
                    "crit",
                    "backend",
                    f"{name} is down: {b.get('consecutive_failures', 0)} connects or health probes in a row "
                    "failed, so routing skips it (requests go to the pool's other backends, or get 503). "
                    "Check that the engine is running and reachable at that URL.",
                )
            )
        elif health == "unknown" and b.get("stale"):
            out.append(
                Finding(
                    "crit",
                    "backend",
                    f"{name} has never answered: its health probe and its /metrics fail "
                    f"({b.get('reason')}). Check that the engine is running and reachable at that URL.",
                )
            )
        elif b.get("stale"):
            out.append(
                Finding(
                    "crit",
                    "kv",
                    f"{name}: its metrics are stale ({b.get('reason')}); routing treats it as saturated. "
                    "Check that the engine is alive and its /metrics answers.",
                )
            )
        elif b.get("saturated"):
            out.append(
                Finding(
                    "crit",
                    "kv",
                    f"{name}: {b.get('reason')}. The engine will preempt (recompute) requests; routing avoids "
                    "it. Lower the pool's capacity_tokens to what the KV cache really holds, or add a backend.",
                )
            )
        elif kv is not None and float(kv) >= 0.8:
            out.append(
                Finding(
                    "warn",
                    "kv",
                    f"{name}: KV cache at {float(kv):.0%}. Close to preemption; consider lowering capacity_tokens.",
                )
            )
        elif (b.get("preemptions_per_s") or 0) > 0:
            out.append(
                Finding(
                    "warn",
                    "kv",
                    f"{name}: {b['preemptions_per_s']:.2f} preemptions/s; the engine is short of KV cache.",
                )
            )
        elif (
            kv is not None and float(kv) < _SLOTS_BOUND_KV and (b.get("waiting") or 0) >= _SLOTS_BOUND_WAITING
        ):
            # Waiting with the cache half empty: what is full is the engine's sequence slots.
            out.append(
                Finding(
                    "warn",
                    "slots",
                    f"{name}: {b['waiting']:.0f} requests wait inside the engine while its KV cache is at "
                    f"{float(kv):.0%}: its sequence slots (--max-num-seqs), not its memory, are full, and "
                    "those requests wait first come first served, out of the gateway's fair queue. Set "
                    "max_num_seqs on this backend to the engine's --max-num-seqs (or lower it).",
                )
            )
    if stats.get("backends") and not out:
        out.append(Finding("ok", "kv", "KV pressure: every scraped backend has room."))
    return out


def _pools(stats: Mapping[str, Any]) -> list[Finding]:
    out = []
    queues = stats.get("queues") or {}
    waiting = sum(int(v) for v in queues.values())
    for p in stats.get("pools", []):
        u = p.get("utilisation")
        if u is not None and u >= 0.95:
            out.append(
                Finding(
                    "warn",
                    "queue",
                    f"{p['kind']} pool {p['name']} is full ({u:.0%} of {p['capacity']} tokens in flight)"
                    + (f"; {waiting} request(s) queued at the gateway." if waiting else "."),
                )
            )
    return out


def _split(stats: Mapping[str, Any]) -> list[Finding]:
    out = []
    for s in stats.get("shape", []):
        adv = int(s.get("advice", 0))
        if adv == 0:
            continue
        plan = s.get("plan") or {}
        how = ""
        if plan.get("moved_classes"):
            how = f" Move class(es) {', '.join(plan['moved_classes'])} to a new pool {plan['new_pool']}."
        elif plan.get("cut_cost"):
            how = f" Send requests costing >= {plan['cut_cost']} tokens to a new pool {plan['new_pool']}."
        out.append(
            Finding(
                "crit" if adv == 2 else "warn",
                "split",
                f"pool {s['pool']}: largest/median request cost is {s['ratio']:.0f}x ({s['advice_words']})."
                f"{how} GET /insights?format=yaml prints the config edit.",
            )
        )
    return out
