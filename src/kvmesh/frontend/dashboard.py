"""``GET /dashboard``: a live page of the cluster, served by the frontend.

One HTML document with its CSS and JavaScript inline (no build step, no external
asset, works offline) and ``GET /dashboard/events``, a server-sent-event stream of
JSON snapshots, one a second: every worker (role, health state, breaker state, KV
usage, requests in flight; a worker that left stays listed as ``gone`` for a minute),
the prefill queue, request-rate / TTFT / ITL history for the sparklines, and the
router's last decisions with their explanation.

A snapshot is built at most twice a second whatever the number of open pages; the
number of open event streams is bounded (``MAX_STREAMS`` in all, 503; ``MAX_STREAMS_PER_KEY``
per API key, 429, so one key's pages cannot lock the others out).

Access: open without API keys (the server binds loopback unless told otherwise). With
keys, every route needs one: ``Authorization: Bearer KEY`` (curl), or the session
cookie a browser gets from ``POST /dashboard/session`` with the key
(``HttpOnly; SameSite=Strict``; :mod:`kvmesh.frontend.auth` makes and checks it),
because ``EventSource`` cannot send a header. ``GET /dashboard`` without either is a
401 whose body is a one-field form that does that exchange and reloads.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.errors import KvmeshError, ResourceExhausted, TooManyRequests, Unauthorized
from kvmesh.frontend.auth import SESSION_S
from kvmesh.frontend.server import Handler, Request, Response
from kvmesh.frontend.sse import SSEResponse
from kvmesh.runtime.context import Context

if TYPE_CHECKING:
    from kvmesh.frontend.app import Frontend

__all__ = ["Dashboard", "MAX_STREAMS", "MAX_STREAMS_PER_KEY", "COOKIE"]

MAX_STREAMS = 32
MAX_STREAMS_PER_KEY = 4  # per API key (without keys: all callers are one)
COOKIE = "kvmesh_dashboard"
_ANONYMOUS = -1
GONE_KEEP_S = 60.0
HISTORY = 120  # seconds of sparkline
_STATUS = ("healthy", "suspicious", "unhealthy", "draining", "dead")
_BREAKER = ("closed", "open", "half_open")


class Dashboard:
    def __init__(
        self, frontend: Frontend, error_response: Callable[[BaseException], Response], interval_s: float = 1.0
    ) -> None:
        self.frontend = frontend
        self._error_response = error_response  # the frontend's error body (no import of frontend.app: a cycle)
        self.interval_s = interval_s
        self._rows: dict[int, dict[str, Any]] = {}  # every worker seen (its last row)
        self._gone: dict[int, float] = {}  # worker id → when it left
        self._history: collections.deque[tuple[float, float, float, float, float, float]] = collections.deque(maxlen=HISTORY + 1)
        self._cached: bytes = b""
        self._cached_at = 0.0
        self._lock = asyncio.Lock()
        self.streams = 0
        self._streams_of: dict[int, int] = {}  # key index (or _ANONYMOUS) → open streams
        self._migrations = 0.0

    # ------------------------------------------------------------------ routes
    def routes(self) -> dict[str, dict[str, Handler]]:
        return {
            "/dashboard": {"GET": self.page},
            "/dashboard/events": {"GET": self.events},
            "/dashboard/session": {"POST": self.session},
        }

    async def page(self, request: Request) -> Response:
        try:
            self._caller(request)
        except Unauthorized:
            return Response(_LOGIN, 401, "text/html; charset=utf-8", {"cache-control": "no-store", "www-authenticate": "Bearer"})
        return Response(_PAGE, content_type="text/html; charset=utf-8", headers={"cache-control": "no-cache"})

    async def session(self, request: Request) -> Response:
        """An API key (header) → a session cookie for this page and its events."""
        auth = self.frontend.auth
        if not auth.required:
            return Response(b"", 204)
        try:
            token = auth.session_token(auth.key_of(request.headers.get("authorization")), time.time())
        except KvmeshError as exc:
            return self._error_response(exc)
        cookie = f"{COOKIE}={token}; Path=/dashboard; Max-Age={SESSION_S}; HttpOnly; SameSite=Strict"
        return Response(b"", 204, headers={"set-cookie": cookie, "cache-control": "no-store"})

    async def events(self, request: Request) -> Response | SSEResponse:
        try:
            caller = self._caller(request)
            if self._streams_of.get(caller, 0) >= MAX_STREAMS_PER_KEY:
                raise TooManyRequests(f"this key has {MAX_STREAMS_PER_KEY} dashboards open already; close one", retry_after=5)
            if self.streams >= MAX_STREAMS:
                raise ResourceExhausted(f"at most {MAX_STREAMS} dashboards may be open; close one", retry_after=5)
        except KvmeshError as exc:
            return self._error_response(exc)
        self.streams += 1
        self._streams_of[caller] = self._streams_of.get(caller, 0) + 1
        ctx = Context("dashboard")
        return SSEResponse(self._stream(ctx), ctx, self.frontend.keepalive, on_close=lambda: self._closed(caller))

    def _caller(self, request: Request) -> int:
        """Whose request (the index of its API key; _ANONYMOUS without keys). Raises
        Unauthorized without a valid key or session cookie."""
        auth = self.frontend.auth
        if not auth.required:
            return _ANONYMOUS
        authorization = request.headers.get("authorization")
        if authorization:
            return auth.key_of(authorization)
        index = auth.session_key(_cookie(request.headers.get("cookie"), COOKIE), time.time())
        if index is None:
            raise Unauthorized("the dashboard needs an API key: open /dashboard in a browser and enter one, or send "
                               "Authorization: Bearer <your key>")  # fmt: skip
        return index

    def _closed(self, caller: int) -> None:
        self.streams -= 1
        left = self._streams_of.pop(caller, 1) - 1
        if left > 0:
            self._streams_of[caller] = left

    async def _stream(self, ctx: Context) -> AsyncGenerator[bytes, None]:
        while not ctx.is_stopped():
            yield b"data: " + await self.snapshot() + b"\n\n"
            try:
                await asyncio.wait_for(ctx.stopped(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------ data
    async def snapshot(self) -> bytes:
        async with self._lock:
            now = time.monotonic()
            if self._cached and now - self._cached_at < self.interval_s / 2:
                return self._cached
            self._cached = msgspec.json.encode(await self._build(now))
            self._cached_at = now
            return self._cached

    async def _build(self, now: float) -> dict[str, Any]:
        fe = self.frontend
        samples = {int(w, 16): m for w, m in await fe.worker_samples(timeout_s=0.5)}
        health = fe.registry.health
        live: set[int] = set()
        for name, entry in sorted(fe.registry.models.items()):
            for inst in entry.instances.all():
                live.add(inst.worker_id)
                self._rows[inst.worker_id] = self._row(inst.worker_id, name, inst.info.address, samples, health)
        for worker_id in fe.prefill_workers:
            live.add(worker_id)
            self._rows[worker_id] = self._row(worker_id, "", "", samples, health, role="prefill")
        for worker_id, row in list(self._rows.items()):
            if worker_id in live:
                self._gone.pop(worker_id, None)
                continue
            left = self._gone.setdefault(worker_id, now)
            if now - left > GONE_KEEP_S:
                del self._rows[worker_id], self._gone[worker_id]
            else:
                row.update(health="gone", breaker="-", in_flight=0, gone_s=round(now - left, 1))
        queue = max((m.disagg.queue_depth for m in samples.values() if m.disagg is not None), default=0)
        return {
            "time": time.time(),
            "router": fe.config.router_mode,
            "workers": [self._rows[w] for w in sorted(self._rows)],
            "prefill_queue": queue,
            "series": self._series(now),
            "migrations": self._migrations,
            "decisions": self._decisions(),
        }

    def _row(
        self, worker_id: int, model: str, address: str, samples: dict[int, Any], health: Any, role: str | None = None
    ) -> dict[str, Any]:
        m = samples.get(worker_id)
        tracker = health.trackers.get(worker_id) if health is not None else None
        return {
            "id": f"{worker_id:x}",
            "model": model,
            "address": address,
            "role": role or (m.mode if m is not None else "aggregated"),
            "health": _STATUS[int(tracker.status)] if tracker is not None else ("unknown" if health is None else "healthy"),
            "breaker": _BREAKER[int(tracker.breaker.state)] if tracker is not None else "-",
            "kv_used": m.kv_blocks_used if m is not None else None,
            "kv_total": m.kv_blocks_total if m is not None else None,
            "in_flight": m.in_flight if m is not None else None,
            "running": m.running if m is not None else None,
            "waiting": m.waiting if m is not None else None,
            "requests": m.requests if m is not None else None,
        }

    def _series(self, now: float) -> dict[str, list[float]]:
        """Per-interval request rate, mean TTFT and mean ITL (ms), from the frontend's
        own counters and histograms."""
        req, ts, tc, its, itc, self._migrations = _totals(self.frontend.metrics.registry)
        self._history.append((now, req, ts, tc, its, itc))
        rate, ttft, itl = [], [], []
        points = list(self._history)
        for (t0, r0, ts0, tc0, is0, ic0), (t1, r1, ts1, tc1, is1, ic1) in zip(points, points[1:]):
            dt = max(t1 - t0, 1e-6)
            rate.append(round((r1 - r0) / dt, 3))
            ttft.append(round((ts1 - ts0) / (tc1 - tc0) * 1000.0, 3) if tc1 > tc0 else 0.0)
            itl.append(round((is1 - is0) / (ic1 - ic0) * 1000.0, 3) if ic1 > ic0 else 0.0)
        return {"rate": rate, "ttft_ms": ttft, "itl_ms": itl}

    def _decisions(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.frontend.tenants is not None:
            return out  # issue 30: tenants in the keys file: another's overlaps would tell what it has cached
        for name, entry in sorted(self.frontend.registry.models.items()):
            recent = getattr(entry.router.policy, "recent", None)
            for rid, d in list(recent or [])[-10:]:
                out.append({
                    "model": name, "request": rid, "worker": f"{d.worker_id:x}", "overlap_blocks": d.overlap_blocks,
                    "why": [
                        {"worker": f"{c.worker_id:x}", "overlap": c.overlap_blocks, "cost": round(c.cost, 3),
                         "weight": c.weight}
                        for c in d.candidates
                    ],
                })  # fmt: skip
        return out[-10:]


def _cookie(header: str | None, name: str) -> str:
    """The value of cookie ``name`` in a Cookie header ("" when absent)."""
    if not header or len(header) > 8192:
        return ""
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""


def _totals(registry: Any) -> tuple[float, float, float, float, float, float]:
    """(requests, TTFT sum, TTFT count, ITL sum, ITL count, migrations) over every model."""
    req = ts = tc = its = itc = moved = 0.0
    for metric in registry.collect():
        if metric.name == "kvmesh_migration":
            moved += sum(s.value for s in metric.samples if s.name.endswith("_total"))
        if metric.name == "kvmesh_frontend_requests":
            req += sum(s.value for s in metric.samples if s.name.endswith("_total"))
        if metric.name == "kvmesh_frontend_time_to_first_token_seconds":
            ts += sum(s.value for s in metric.samples if s.name.endswith("_sum"))
            tc += sum(s.value for s in metric.samples if s.name.endswith("_count"))
        elif metric.name == "kvmesh_frontend_inter_token_latency_seconds":
            its += sum(s.value for s in metric.samples if s.name.endswith("_sum"))
            itc += sum(s.value for s in metric.samples if s.name.endswith("_count"))
    return req, ts, tc, its, itc, moved


_PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvmesh cluster</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#0f1419;color:#e6e6e6}
header{padding:10px 18px;background:#1b2430;display:flex;gap:24px;align-items:baseline}
h1{font-size:18px;margin:0}h2{font-size:14px;margin:14px 0 6px;color:#9fb3c8;text-transform:uppercase;letter-spacing:.05em}
main{padding:0 18px 18px}table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #2a3441}th{color:#9fb3c8;font-weight:600}
.st{padding:1px 8px;border-radius:9px;font-weight:600}
.healthy,.closed{background:#1f5130;color:#b7f5c8}.suspicious,.half_open{background:#5c4d14;color:#fde68a}
.unhealthy,.open,.draining{background:#6b2a12;color:#fed7aa}.dead,.gone{background:#5b1a1a;color:#fecaca}
.unknown{background:#333;color:#ccc}
.bar{background:#2a3441;height:10px;width:120px;display:inline-block;vertical-align:middle}
.bar>span{display:block;height:100%;background:#4f9cf9}
.sparks{display:flex;gap:24px;flex-wrap:wrap}.spark{background:#1b2430;padding:8px 12px;border-radius:6px}
.spark b{display:block;font-size:20px}svg{display:block}polyline{fill:none;stroke:#4f9cf9;stroke-width:1.5}
#conn.down{color:#fca5a5}code{color:#9fb3c8}
</style></head><body>
<header><h1>kvmesh cluster</h1><span>router: <b id="router">-</b></span><span>prefill queue: <b id="queue">0</b></span>
<span>workers: <b id="count">0</b></span><span>streams migrated: <b id="migrations">0</b></span><span id="conn">connecting...</span></header>
<main>
<h2>Traffic</h2>
<div class="sparks">
<div class="spark">requests/s <b id="rate">-</b><svg id="s-rate" width="240" height="40"></svg></div>
<div class="spark">TTFT ms (mean) <b id="ttft">-</b><svg id="s-ttft" width="240" height="40"></svg></div>
<div class="spark">ITL ms (mean) <b id="itl">-</b><svg id="s-itl" width="240" height="40"></svg></div>
</div>
<h2>Workers</h2>
<table><thead><tr><th>worker</th><th>role</th><th>health</th><th>breaker</th><th>KV blocks</th><th>in flight</th>
<th>running / waiting</th><th>requests</th><th>address</th></tr></thead><tbody id="workers"></tbody></table>
<h2>Last routing decisions</h2>
<table><thead><tr><th>request</th><th>worker</th><th>overlap blocks</th><th>why (candidates: overlap, cost, weight)</th></tr></thead>
<tbody id="decisions"></tbody></table>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function cell(text, cls) { const td = document.createElement("td"); if (cls) { const s = document.createElement("span");
  s.className = "st " + cls; s.textContent = text; td.appendChild(s); } else { td.textContent = text; } return td; }
function bar(used, total) { const td = document.createElement("td"); if (total == null) { td.textContent = "-"; return td; }
  const b = document.createElement("span"); b.className = "bar"; const f = document.createElement("span");
  f.style.width = (total ? Math.min(100, 100 * used / total) : 0) + "%"; b.appendChild(f); td.appendChild(b);
  td.appendChild(document.createTextNode(" " + used + " / " + total)); return td; }
function spark(id, values) { const svg = $(id); const w = 240, h = 40; const max = Math.max(1e-9, ...values);
  const pts = values.map((v, i) => (i * w / Math.max(1, values.length - 1)).toFixed(1) + "," + (h - 2 - (h - 4) * v / max).toFixed(1));
  svg.innerHTML = '<polyline points="' + pts.join(" ") + '"></polyline>'; }
function last(a) { return a.length ? a[a.length - 1] : 0; }
function render(s) {
  $("router").textContent = s.router; $("queue").textContent = s.prefill_queue; $("migrations").textContent = s.migrations;
  $("count").textContent = s.workers.filter((w) => w.health !== "gone").length;
  const body = $("workers"); body.replaceChildren();
  for (const w of s.workers) {
    const tr = document.createElement("tr"); tr.dataset.worker = w.id; tr.dataset.health = w.health; tr.dataset.role = w.role;
    tr.append(cell(w.id), cell(w.role), cell(w.health + (w.gone_s != null ? " " + w.gone_s + "s" : ""), w.health),
      cell(w.breaker, w.breaker === "-" ? "" : w.breaker), bar(w.kv_used, w.kv_total), cell(w.in_flight ?? "-"),
      cell((w.running ?? "-") + " / " + (w.waiting ?? "-")), cell(w.requests ?? "-"), cell(w.address || "-"));
    body.appendChild(tr);
  }
  const d = $("decisions"); d.replaceChildren();
  for (const x of s.decisions.slice().reverse()) {
    const tr = document.createElement("tr");
    tr.append(cell(x.request), cell(x.worker), cell(x.overlap_blocks),
      cell(x.why.map((c) => c.worker + ": " + c.overlap + ", " + c.cost + ", " + c.weight).join(" | ")));
    d.appendChild(tr);
  }
  if (!s.decisions.length) { const tr = document.createElement("tr"); tr.append(cell("(the " + s.router +
    " router explains no decisions; --router-mode kv does)")); d.appendChild(tr); }
  spark("s-rate", s.series.rate); spark("s-ttft", s.series.ttft_ms); spark("s-itl", s.series.itl_ms);
  $("rate").textContent = last(s.series.rate).toFixed(1); $("ttft").textContent = last(s.series.ttft_ms).toFixed(1);
  $("itl").textContent = last(s.series.itl_ms).toFixed(2);
  document.body.dataset.updated = String(s.time);
}
const es = new EventSource("dashboard/events");
es.onmessage = (e) => { $("conn").textContent = "live"; $("conn").className = ""; render(JSON.parse(e.data)); };
es.onerror = () => {
  $("conn").className = "down";
  if (es.readyState === EventSource.CLOSED) {  // refused (session expired, too many pages): ask again soon
    $("conn").textContent = "closed by the server; reloading..."; setTimeout(() => location.reload(), 5000);
  } else { $("conn").textContent = "reconnecting..."; }
};
</script></body></html>
"""


_LOGIN = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvmesh cluster</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#0f1419;color:#e6e6e6;display:flex;justify-content:center}
form{margin-top:15vh;background:#1b2430;padding:18px 24px;border-radius:6px;width:360px}
h1{font-size:18px;margin:0 0 8px}input,button{font:inherit;padding:6px 8px;margin-top:8px}input{width:100%;box-sizing:border-box}
#msg{color:#fca5a5;min-height:1.4em}
</style></head><body>
<form id="login"><h1>kvmesh cluster</h1>
<div>This frontend has API keys: enter one to open the live page. The key is sent once, in a header,
for a session cookie (12 hours); it is not stored by this page.</div>
<input id="key" type="password" autocomplete="off" placeholder="API key" autofocus>
<button type="submit">Open</button><div id="msg"></div></form>
<script>
"use strict";
document.getElementById("login").addEventListener("submit", async (e) => {
  e.preventDefault();
  const input = document.getElementById("key"), msg = document.getElementById("msg");
  const key = input.value.trim(); input.value = "";
  try {
    const r = await fetch("dashboard/session", {method: "POST", headers: {authorization: "Bearer " + key}, credentials: "same-origin"});
    if (r.ok) { location.reload(); return; }
    msg.textContent = r.status === 401 ? "not a valid API key" : "refused (" + r.status + ")";
  } catch (err) { msg.textContent = "could not send the key: " + err; }
});
</script></body></html>
"""
