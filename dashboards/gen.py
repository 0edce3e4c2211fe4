#!/usr/bin/env python3
"""Generates sandpool's Grafana dashboards (dashboards/*.json) from the panel lists below.

    python3 dashboards/gen.py           write overview.json, pools.json, tenants.json, exec.json
    python3 dashboards/gen.py --check   exit 1 (naming the files) if a committed file differs

The JSON files are committed; CI (tests/tests/it/observe.rs) runs --check, so edit this file
and regenerate, never the JSON. Output is deterministic: no timestamps, ids from the order of
the panels.

Every metric named here must be in telemetry/src/names.rs (the catalog); CI checks that every
metric any panel names exists in a scrape of a running stack and that every panel's query,
evaluated by a real Prometheus, returns data. Dashboard variables: ${datasource} (a Prometheus
data source), $node, $template, $tenant (multi-select, "All" = regex .*).

Python 3 standard library only.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
SCHEMA_VERSION = 39
# The alert thresholds (dashboards/alerts.yml), drawn on the panels they belong to.
WARM_RATIO_TARGET = 0.9
QUEUE_WAIT_P99_MAX_S = 5
HEARTBEAT_STALE_S = 10


# ── variables ─────────────────────────────────────────────────────────────────────────────


def datasource_var():
    return {
        "current": {},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


def query_var(name, label, query):
    return {
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": DS,
        "definition": query,
        "hide": 0,
        "includeAll": True,
        "label": label,
        "multi": True,
        "name": name,
        "options": [],
        "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


NODE = query_var("node", "Node", "label_values(sandpool_node_sandboxes, node)")
TEMPLATE = query_var("template", "Template", 'label_values(sandpool_pool_target{node=~"$node"}, template)')
TENANT = query_var("tenant", "Tenant", 'label_values(sandpool_sessions_active{node=~"$node"}, tenant)')


# ── panels ────────────────────────────────────────────────────────────────────────────────


def target(expr, legend="__auto", ref="A", fmt=None, instant=False):
    t = {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "refId": ref,
    }
    if fmt:
        t["format"] = fmt
    return t


def targets(queries, instant=False):
    """[(expr, legend)] -> targets with refIds A, B, ..."""
    return [target(e, l, chr(ord("A") + i), instant=instant) for i, (e, l) in enumerate(queries)]


def thresholds(steps):
    """steps: [(value or None, color)]; the first value is None (the base)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


BASE_THRESHOLDS = thresholds([(None, "green")])


def timeseries(title, queries, unit="short", desc="", w=12, h=8, stack=False, bars=False, min0=True,
               line_at=None, overrides=None, repeat=None):
    """A time series panel; line_at draws a dashed threshold line (an alert's threshold)."""
    custom = {
        "axisBorderShow": False,
        "axisPlacement": "auto",
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 60 if bars else (25 if stack else 10),
        "gradientMode": "none",
        "lineInterpolation": "linear",
        "lineWidth": 1,
        "pointSize": 4,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stack else "none"},
        "thresholdsStyle": {"mode": "dashed" if line_at is not None else "off"},
    }
    defaults = {
        "color": {"mode": "palette-classic"},
        "custom": custom,
        "thresholds": thresholds([(None, "transparent"), (line_at, "red")]) if line_at is not None
        else BASE_THRESHOLDS,
        "unit": unit,
    }
    if min0:
        defaults["min"] = 0
    p = {
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"calcs": ["lastNotNull", "max"], "displayMode": "table", "placement": "bottom",
                       "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets(queries),
        "_size": (w, h),
    }
    if repeat:
        p["repeat"] = repeat
        p["repeatDirection"] = "h"
        p["maxPerRow"] = 3
    return p


def stat(title, expr, unit="short", desc="", w=4, h=4, steps=None, decimals=None, graph=True):
    defaults = {"color": {"mode": "thresholds"}, "thresholds": thresholds(steps) if steps else BASE_THRESHOLDS,
                "unit": unit}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "colorMode": "value",
            "graphMode": "area" if graph else "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
        "targets": targets([(expr, "__auto")]),
        "_size": (w, h),
    }


def gauge(title, expr, unit="percentunit", desc="", w=4, h=6, steps=None):
    return {
        "type": "gauge",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": {"color": {"mode": "thresholds"}, "min": 0, "max": 1, "unit": unit,
                                     "thresholds": thresholds(steps) if steps else BASE_THRESHOLDS},
                        "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "showThresholdLabels": False, "showThresholdMarkers": True},
        "targets": targets([(expr, "__auto")]),
        "_size": (w, h),
    }


def bargauge(title, expr, legend, unit="short", desc="", w=8, h=8):
    return {
        "type": "bargauge",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": {"color": {"mode": "continuous-GrYlRd"}, "min": 0, "unit": unit,
                                     "thresholds": BASE_THRESHOLDS},
                        "overrides": []},
        "options": {"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": targets([(expr, legend)], instant=True),
        "_size": (w, h),
    }


def heatmap(title, expr, desc="", w=12, h=8):
    return {
        "type": "heatmap",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": {"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False},
                                                "scaleDistribution": {"type": "linear"}}},
                        "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Spectral", "steps": 64, "exponent": 0.5, "fill": "dark-orange",
                      "reverse": False, "scale": "exponential"},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "showColorScale": False, "yHistogram": True},
            "yAxis": {"axisPlacement": "left", "reverse": False, "unit": "s"},
        },
        "targets": [target(expr, "{{le}}", fmt="heatmap")],
        "_size": (w, h),
    }


def state_timeline(title, expr, legend, desc="", w=12, h=8):
    return {
        "type": "state-timeline",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "thresholds"},
                "custom": {"fillOpacity": 80, "lineWidth": 0},
                "mappings": [{"type": "value", "options": {
                    "0": {"color": "red", "index": 0, "text": "backing off"},
                    "1": {"color": "green", "index": 1, "text": "healthy"}}}],
                "thresholds": thresholds([(None, "red"), (1, "green")]),
            },
            "overrides": [],
        },
        "options": {"alignValue": "left", "mergeValues": True, "rowHeight": 0.9, "showValue": "auto",
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
                    "tooltip": {"mode": "single", "sort": "none"}},
        "targets": targets([(expr, legend)]),
        "_size": (w, h),
    }


def text(title, content, w=24, h=3):
    return {"type": "text", "title": title, "options": {"mode": "markdown", "content": content},
            "_size": (w, h)}


def row(title):
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (24, 1)}


def layout(items):
    """Gives panels ids and grid positions: left to right, wrapping at 24 columns; a row starts a
    new line."""
    out, x, y, line_h = [], 0, 0, 0
    for i, p in enumerate(items, start=1):
        p = dict(p)
        w, h = p.pop("_size")
        if p["type"] == "row" or x + w > 24:
            x, y, line_h = 0, y + line_h, 0
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        p["id"] = i
        x += w
        line_h = max(line_h, h)
        if p["type"] == "row":
            x, y, line_h = 0, y + h, 0
        out.append(p)
    return out


def dashboard(uid, title, desc, variables, items):
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": desc,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"asDropdown": True, "icon": "external link", "includeVars": True, "keepTime": True,
                   "tags": ["sandpool"], "targetBlank": False, "title": "sandpool", "type": "dashboards"}],
        "panels": layout(items),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["sandpool"],
        "templating": {"list": [datasource_var()] + variables},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def q(metric, *matchers):
    """metric{m1,m2,...}"""
    return metric + ("{" + ",".join(matchers) + "}" if matchers else "")


def rate(metric, *matchers):
    return f"rate({q(metric, *matchers)}[{RI}])"


def quantile(phi, hist, by, *matchers):
    by = ", ".join(["le"] + list(by))
    return f"histogram_quantile({phi}, sum by ({by}) ({rate(hist + '_bucket', *matchers)}))"


N = 'node=~"$node"'
T = 'template=~"$template"'
GW = 'service="gateway"'
WARM = 'start="warm"'
S5XX = 'status=~"5.."'
IDLE = 'state="idle"'
COMBINED = 'policy="combined"'
# The autoscaler's per-step targets are not per node: node="all".
ALL_NODES = 'node="all"'
FAILING = 'outcome=~"timeout|error"'


# ── overview ──────────────────────────────────────────────────────────────────────────────

HTTP = "sandpool_http_requests_total"
HTTP_D = "sandpool_http_request_duration_seconds"
CREATED = "sandpool_sessions_created_total"
WARM_RATIO = f"(sum({rate(CREATED, T, WARM)}) or vector(0)) / sum({rate(CREATED, T)})"


def overview():
    return dashboard(
        "sandpool-overview", "sandpool / Overview",
        "Gateway traffic, session starts, queues and rejections. Gateway series have no node label: "
        "they are per gateway process (Prometheus' instance label).",
        [NODE, TEMPLATE],
        [
            row("Now"),
            stat("Requests", f"sum({rate(HTTP, GW)})", "reqps", "Gateway requests per second, all routes."),
            stat("5xx ratio", f'(sum({rate(HTTP, GW, S5XX)}) or vector(0)) '
                              f"/ sum({rate(HTTP, GW)})", "percentunit",
                 "Share of gateway answers that were 5xx (503 included: no sandbox in time, an unhealthy template).",
                 steps=[(None, "green"), (0.01, "orange"), (0.05, "red")], decimals=2),
            stat("Warm ratio", WARM_RATIO, "percentunit",
                 "Sessions that started on an idle sandbox, of all sessions created.",
                 steps=[(None, "red"), (WARM_RATIO_TARGET, "green")], decimals=1),
            stat("Live sessions", f"sum({q('sandpool_sessions_active', N)})", "short",
                 "Sessions alive now on the selected nodes."),
            stat("Waiting requests", f"sum({q('sandpool_pool_waiting', N, T)})", "short",
                 "Create requests waiting in a queue for a sandbox now.",
                 steps=[(None, "green"), (1, "orange")]),
            stat("Rejections", f"sum({rate('sandpool_session_rejections_total', T)})", "reqps",
                 "Create requests refused per second (429 queue full, 503 deadline or unhealthy template).",
                 steps=[(None, "green"), (0.001, "red")]),
            row("Requests"),
            timeseries("Request rate by route", [(f"sum by (route) ({rate(HTTP, GW)})", "{{route}}")], "reqps",
                       "Gateway requests per second by route template.", w=8),
            timeseries("5xx rate by route",
                       [(f'sum by (route, status) ({rate(HTTP, GW, S5XX)})',
                         "{{status}} {{route}}")], "reqps",
                       "Gateway 5xx answers per second by route and status. A 5xx body carries a request id; the "
                       "cause is in that gateway's log under it.", w=8),
            timeseries("Latency p50 / p99 by route",
                       [(quantile(0.5, HTTP_D, ["route"], GW), "p50 {{route}}"),
                        (quantile(0.99, HTTP_D, ["route"], GW), "p99 {{route}}")], "s",
                       "Time to the response head (a WebSocket's lifetime is not included). POST /v1/sessions "
                       "includes any queue wait.", w=8),
            row("Sessions"),
            timeseries("Sessions created: warm vs cold", [(f"sum by (start) ({rate(CREATED, T)})", "{{start}}")],
                       "ops", "warm: an idle sandbox was checked out; cold: the request waited for one being "
                       "created.", w=8, stack=True),
            timeseries("Warm ratio by template",
                       [(f'(sum by (template) ({rate(CREATED, T, WARM)}) '
                         f"or (0 * sum by (template) ({rate(CREATED, T)}))) "
                         f"/ sum by (template) ({rate(CREATED, T)})", "{{template}}")],
                       "percentunit", "Warm starts of all starts, per template. The alert fires below "
                       f"{WARM_RATIO_TARGET:.0%}.", w=8, line_at=WARM_RATIO_TARGET),
            timeseries("Live sessions by node", [(f"sum by (node) ({q('sandpool_sessions_active', N)})", "{{node}}")],
                       "short", "Sessions alive now, per node.", w=8, stack=True),
            timeseries("Checkout time p99 by start",
                       [(quantile(0.99, "sandpool_session_checkout_duration_seconds", ["start"], T), "p99 {{start}}"),
                        (quantile(0.5, "sandpool_session_checkout_duration_seconds", ["start"], T), "p50 {{start}}")],
                       "s", "From a create request to its grant, queue wait included.", w=8),
            timeseries("Sessions ended by reason",
                       [(f"sum by (reason) ({rate('sandpool_sessions_ended_total')})", "{{reason}}")], "ops",
                       "deleted by the caller, expired (idle), max_lifetime, sandbox_failed, create_failed, removed.",
                       w=8, stack=True),
            timeseries("Rejections by code",
                       [(f"sum by (code) ({rate('sandpool_session_rejections_total', T)})", "{{code}}")], "reqps",
                       "queue_full (429), deadline (503: no sandbox within max_wait_s), unhealthy (503: the "
                       "template's image fails to start), no_node (503).", w=8, stack=True),
            row("Queues"),
            timeseries("Queue depth by template",
                       [(f"sum by (template) ({q('sandpool_pool_waiting', N, T)})", "{{template}}")], "short",
                       "Create requests waiting for a sandbox, per template (all selected nodes).", stack=True),
            timeseries("Queue wait p99 by template",
                       [(quantile(0.99, "sandpool_session_queue_wait_seconds", ["template"], T), "p99 {{template}}"),
                        (quantile(0.5, "sandpool_session_queue_wait_seconds", ["template"], T), "p50 {{template}}")],
                       "s", "Time queued requests waited (requests that found an idle sandbox are not counted). "
                       f"The alert fires above {QUEUE_WAIT_P99_MAX_S} s.", line_at=QUEUE_WAIT_P99_MAX_S),
        ],
    )


# ── pools and nodes ───────────────────────────────────────────────────────────────────────

CREATES = "sandpool_sandbox_creates_total"
LAZY = "sandpool_lazy"
FETCH_ERROR = 'outcome="error"'


def pools():
    return dashboard(
        "sandpool-pools", "sandpool / Pools and nodes",
        "Per node and template: sandboxes by state against the idle target, the autoscaler's steps, "
        "creates against the node's budget, failures, node capacity, heartbeats and template health; "
        "lazy images: bytes fetched, the chunk cache and its bound, fetch latency and errors.",
        [NODE, TEMPLATE],
        [
            row("Pools"),
            timeseries("$template: sandboxes by state vs target",
                       [(f"sum by (state) ({q('sandpool_pool_sandboxes', N, T)})", "{{state}}"),
                        (f"sum({q('sandpool_pool_target', N, T)})", "idle target"),
                        (f"sum({q('sandpool_pool_waiting', N, T)})", "waiting requests")],
                       "short", "idle / leased / creating / paused sandboxes of the pool (all selected nodes), "
                       "the idle count the nodes steer to, and requests waiting. One panel per selected template.",
                       w=24, repeat="template",
                       overrides=[{"matcher": {"id": "byName", "options": "idle target"},
                                   "properties": [{"id": "custom.lineStyle", "value": {"dash": [10, 10],
                                                                                      "fill": "dash"}},
                                                  {"id": "color", "value": {"fixedColor": "red",
                                                                            "mode": "fixed"}}]}]),
            timeseries("Idle short of target",
                       [(f"sum by (node, template) ({q('sandpool_pool_target', N, T)}) - sum by (node, template) "
                         f"({q('sandpool_pool_sandboxes', N, T, IDLE)})",
                         "{{node}} {{template}}")],
                       "short", "Target minus idle per node and pool: above 0, the pool is catching up (creates in "
                       "flight or throttled by the budget); below 0, idle beyond a lowered target is retired.",
                       w=8, min0=False),
            timeseries("Autoscaler: each step's target",
                       [(f"sum by (template, policy) ({q('sandpool_autoscaler_target', ALL_NODES, T)})",
                         "{{template}} {{policy}}")],
                       "short", "What each step of the autoscaler's policy asks for, per template, before the "
                       "result is fitted to the nodes: reservations, forecast (learned bursts), reactive "
                       "(queue and arrival rate). These series carry node=\"all\".", w=8),
            timeseries("Autoscaler: combined target per node",
                       [(f"sum by (node, template) "
                         f"({q('sandpool_autoscaler_target', N, T, COMBINED)})",
                         "{{node}} {{template}}")],
                       "short", "The idle target the autoscaler sends each node (policy=\"combined\"); a node "
                       "follows it while it is fresh, else its template's warm.", w=8),
            timeseries("Forecast bursts",
                       [(q("sandpool_autoscaler_forecast_sandboxes", T), "size {{template}}"),
                        (q("sandpool_reservations_pending", T), "reserved {{template}}")],
                       "short", "Size of the next burst the learned policy expects, and sandboxes held by "
                       "reservations.", w=12),
            timeseries("Next forecast burst in",
                       [(q("sandpool_autoscaler_forecast_next_burst_seconds", T), "{{template}}")], "s",
                       "Seconds until the learned policy expects the next burst of a template.", w=12, min0=False),
            state_timeline("Template health",
                           f"min by (node, template) ({q('sandpool_template_healthy', N, T)})",
                           "{{node}} {{template}}",
                           "healthy: sandboxes start; backing off: creates failed and the template waits "
                           "(0.5 s … 60 s) before trying again; its callers get 503 naming the image.", w=24, h=6),
            row("Creates"),
            timeseries("Create rate vs budget",
                       [(f"sum by (node) ({rate(CREATES, N, T)})", "creates {{node}}"),
                        (q("sandpool_node_create_rate_per_second", N), "sustained (EWMA) {{node}}"),
                        (q("sandpool_node_create_budget_per_second", N), "budget {{node}}")],
                       "ops", "Sandbox creates finished per second against the node's create_rate (token "
                       "bucket)."),
            timeseries("Create window",
                       [(q("sandpool_node_create_window", N), "window {{node}}")],
                       "short", "Creates each node keeps in flight: its window grows while create latency "
                       "holds and shrinks when creates queue inside Docker (at most max_creates_in_flight)."),
            timeseries("Creates by outcome",
                       [(f"sum by (template, outcome) ({rate(CREATES, N, T)})", "{{template}} {{outcome}}")],
                       "ops", "Creates finished, ok or failed, per template.", stack=True),
            timeseries("Create failures by cause",
                       [(f"sum by (template, cause) ({rate('sandpool_sandbox_create_failures_total', N, T)})",
                         "{{template}} {{cause}}")],
                       "ops", "image: the image is missing or cannot be used; runtime: Docker refused or failed "
                       "to start it; agent: the agent did not come up; timeout; other. Docker's words are in the "
                       "node's log.", w=8, stack=True),
            timeseries("Create latency p50 / p99",
                       [(quantile(0.5, "sandpool_sandbox_create_duration_seconds", ["template"], N, T),
                         "p50 {{template}}"),
                        (quantile(0.99, "sandpool_sandbox_create_duration_seconds", ["template"], N, T),
                         "p99 {{template}}")],
                       "s", "Create, start and ready one sandbox.", w=8),
            timeseries("Destroys by reason",
                       [(f"sum by (reason) ({rate('sandpool_sandbox_destroys_total', N)})", "{{reason}}")], "ops",
                       "Sandboxes destroyed per second, by reason.", w=8, stack=True),
            row("Nodes"),
            timeseries("Capacity vs sandboxes",
                       [(q("sandpool_node_capacity_sandboxes", N), "capacity {{node}}"),
                        (q("sandpool_node_sandboxes", N), "sandboxes {{node}}")],
                       "short", "Sandboxes a node holds in any state, against max_sandboxes.", w=8),
            gauge("Fill", f"sum({q('sandpool_node_sandboxes', N)}) / sum({q('sandpool_node_capacity_sandboxes', N)})",
                  desc="Sandboxes held of the selected nodes' capacity.", w=4, h=8,
                  steps=[(None, "green"), (0.8, "orange"), (0.95, "red")]),
            timeseries("Heartbeat age",
                       [(f"max by (node) ({q('sandpool_node_heartbeat_age_seconds', N)})", "{{node}}")], "s",
                       "Seconds since a node's last heartbeat, as the autoscaler reads it (every 2 s when "
                       f"healthy). The alert fires above {HEARTBEAT_STALE_S} s.", line_at=HEARTBEAT_STALE_S),
            row("Lazy images"),
            bargauge("Share of each lazy image fetched",
                     f"sum by (image) ({q(LAZY + '_fetched_bytes_total', N)}) / "
                     f"max by (image) ({q(LAZY + '_image_bytes', N)})", "{{image}}", "percentunit",
                     "Bytes fetched from the registry (on demand, read-ahead, prefetch) over the image's blob size, "
                     "per lazy image mounted on the selected nodes: what a whole pull would have moved is 100 %.",
                     w=8),
            timeseries("Lazy image bytes fetched vs size",
                       [(f"sum by (image) ({q(LAZY + '_fetched_bytes_total', N)})", "fetched {{image}}"),
                        (f"max by (image) ({q(LAZY + '_image_bytes', N)})", "size {{image}}")],
                       "bytes", "Per lazy image: bytes fetched since its mount, and its blob's size.", w=16),
            timeseries("Chunk reads by outcome",
                       [(f"sum by (outcome) ({rate(LAZY + '_chunk_reads_total', N)})", "{{outcome}}")],
                       "ops", "hit: served by the node's chunk cache; miss: fetched from the registry; error: "
                       "the fetch failed and the reading process got EIO (the registry is gone or a chunk does not "
                       "match its digest).", w=8, stack=True),
            timeseries("Chunk fetch latency p50 / p99",
                       [(quantile(0.5, LAZY + "_fetch_duration_seconds", ["node"], N), "p50 {{node}}"),
                        (quantile(0.99, LAZY + "_fetch_duration_seconds", ["node"], N), "p99 {{node}}")],
                       "s", "Registry range reads of one chunk (1 MiB), as sandpool-lazyd times them.", w=8),
            timeseries("Chunk fetch errors",
                       [(f"sum by (node, image) ({rate(LAZY + '_chunk_reads_total', N, FETCH_ERROR)})",
                         "{{node}} {{image}}")],
                       "ops", "Failed chunk fetches per lazy image: each one an EIO in a sandbox.", w=8, bars=True),
            timeseries("Image disk: pulled images + chunk cache vs bound",
                       [(q("sandpool_image_disk_bytes", N), "pulled + chunks {{node}}"),
                        (q(LAZY + "_cache_bytes", N), "chunk cache {{node}}"),
                        (q(LAZY + "_cache_limit_bytes", N), "chunk cache bound {{node}}")],
                       "bytes", "The node's image disk (images.disk_budget_mb) holds pulled images and the lazy "
                       "chunk cache; the cache's bound is what the pulled images leave.", w=12),
            timeseries("Profile chunks prefetched",
                       [(f"sum by (node) ({rate(LAZY + '_prefetched_chunks_total', N)})", "{{node}}")],
                       "ops", "Chunks a prefetch of a lazy image fetched ahead of any reader: its recorded access "
                       "profile (what a first session read on some node, kept in the ledger).", w=12, bars=True),
        ],
    )


# ── tenants ───────────────────────────────────────────────────────────────────────────────

ACTIVE = "sandpool_sessions_active"
NTN = [N, 'tenant=~"$tenant"']

TENANTS_NOTE = (
    "Live sessions are counted per top-level tenant (`sandpool_sessions_active`). HTTP traffic and "
    "rejections carry no tenant label (by design: bounded cardinality), so rejections are shown by code "
    "and template for all tenants, and quota refusals by dimension (`sandpool_quota_refusals_total`). "
    "Per-path limits and usage: `GET /v1/quotas/{path}` or `sandpool quota get PATH`."
)


def tenants():
    return dashboard(
        "sandpool-tenants", "sandpool / Tenants",
        "Live sessions per tenant, the largest tenants, and create rejections.",
        [NODE, TENANT],
        [
            text("About", TENANTS_NOTE),
            stat("Tenants with live sessions", f"count(sum by (tenant) ({q(ACTIVE, *NTN)}) > 0) or vector(0)",
                 "short", "Tenants holding at least one live session now.", w=6, graph=False),
            stat("Live sessions", f"sum({q(ACTIVE, *NTN)})", "short", "Live sessions of the selected tenants.", w=6),
            stat("Largest tenant's share",
                 f"max(sum by (tenant) ({q(ACTIVE, *NTN)})) / sum({q(ACTIVE, N)})", "percentunit",
                 "The biggest tenant's share of all live sessions on the selected nodes.", w=6,
                 steps=[(None, "green"), (0.5, "orange"), (0.8, "red")]),
            stat("Rejections", f"sum({rate('sandpool_session_rejections_total')})", "reqps",
                 "Create requests refused per second, all tenants.", w=6, steps=[(None, "green"), (0.001, "red")]),
            timeseries("Live sessions per tenant",
                       [(f"sum by (tenant) ({q(ACTIVE, *NTN)})", "{{tenant}}")], "short",
                       "Sessions alive now, per top-level tenant.", w=16, stack=True),
            bargauge("Top tenants now", f"topk(10, sum by (tenant) ({q(ACTIVE, *NTN)}))", "{{tenant}}",
                     desc="The 10 tenants with the most live sessions now."),
            bargauge("Top tenants over the range",
                     f"topk(10, max by (tenant) (max_over_time({q(ACTIVE, *NTN)}[$__range])))", "{{tenant}}",
                     desc="The 10 tenants with the highest live-session peak over the time range shown."),
            timeseries("Live sessions per tenant and node",
                       [(f"sum by (tenant, node) ({q(ACTIVE, *NTN)})", "{{tenant}} @ {{node}}")], "short",
                       "Where each tenant's sessions live.", w=8),
            timeseries("Rejections by code and template",
                       [(f"sum by (code, template) ({rate('sandpool_session_rejections_total')})",
                         "{{code}} {{template}}")], "reqps",
                       "All tenants (no tenant label): queue_full, deadline, unhealthy, no_node, quota.", w=8, stack=True),
            timeseries("Quota refusals by dimension",
                       [(f"sum by (dimension) ({rate('sandpool_quota_refusals_total')})", "{{dimension}}")], "reqps",
                       "Requests refused by a quota (429 quota_exceeded), all tenants: sessions, cpus, memory_mb, "
                       "create_rate, queued, reserved, private_templates, call_rate.", w=24, stack=True),
        ],
    )


# ── exec and streams ──────────────────────────────────────────────────────────────────────

EXEC = "sandpool_exec_duration_seconds"
FN = "sandpool_function"


def exec_():
    return dashboard(
        "sandpool-exec", "sandpool / Exec and streams",
        "Exec round trips at the pool-manager, function invocations, session WebSockets, and the "
        "dependencies: Redis and Docker.",
        [NODE, TEMPLATE],
        [
            row("Exec"),
            heatmap("Exec latency", f"sum by (le) (increase({q(EXEC + '_bucket', T)}[{RI}]))",
                    "Exec round trips at the pool-manager per latency bucket (all outcomes)."),
            timeseries("Execs by outcome", [(f"sum by (outcome) ({rate(EXEC + '_count', T)})", "{{outcome}}")],
                       "ops", "exit: the command ran to an exit code (non-zero and 127 included); timeout: killed "
                       "at its timeout_ms; error: the call failed.", stack=True),
            timeseries("Timeouts and errors by template",
                       [(f"sum by (template, outcome) "
                         f"({rate(EXEC + '_count', T, FAILING)})",
                         "{{template}} {{outcome}}")],
                       "ops", "Execs that timed out or failed, per template.", w=8, bars=True),
            timeseries("Exec latency p50 / p99 by template",
                       [(quantile(0.5, EXEC, ["template"], T, 'outcome="exit"'), "p50 {{template}}"),
                        (quantile(0.99, EXEC, ["template"], T, 'outcome="exit"'), "p99 {{template}}")],
                       "s", "Execs that exited, per template.", w=16),
            row("Functions"),
            timeseries("Invocations by outcome",
                       [(f"sum by (mode, outcome) ({rate(FN + '_invocations_total')})", "{{mode}} {{outcome}}")],
                       "ops", "ok: a result; handled / unhandled: the function's own error (200 with "
                       "x-sandpool-function-error); timeout (504) and crashed (502) retire the environment; "
                       "error: the call failed before the function ran.", w=8, stack=True),
            timeseries("Invocation latency p50 / p99",
                       [(quantile(0.5, FN + "_invoke_duration_seconds", ["mode", "start"]), "p50 {{mode}} {{start}}"),
                        (quantile(0.99, FN + "_invoke_duration_seconds", ["mode", "start"]), "p99 {{mode}} {{start}}")],
                       "s", "At the gateway; a cold invocation includes its environment's start (a session and, "
                       "in runtime mode, the worker's READY).", w=8),
            timeseries("Environments made / invocations refused",
                       [(f"sum by (why) ({rate(FN + '_environments_made_total')})", "made: {{why}}"),
                        (f"sum by (reason) ({rate(FN + '_refusals_total')})", "refused: {{reason}}")],
                       "ops", "demand: an invocation found no idle environment (a cold start); keeper: made "
                       "ahead (min_warm, Little's law). Refused: 429 at a function's max_concurrency.", w=8,
                       bars=True),
            row("Streams"),
            timeseries("WebSocket sessions open",
                       [(f"sum by (service) (sandpool_ws_sessions_open)", "{{service}}")], "short",
                       "Session WebSockets open now, at the gateway (client side) and the pool-manager.", w=8),
            timeseries("WebSocket bytes in / out",
                       [(f"sum by (service, direction) ({rate('sandpool_ws_bytes_total')})",
                         "{{service}} {{direction}}")], "Bps",
                       "Payload bytes relayed; in: from the client, out: to it.", w=16),
            row("Dependencies"),
            timeseries("Redis script latency p99",
                       [(quantile(0.99, "sandpool_redis_script_duration_seconds", ["script"]), "{{script}}")], "s",
                       "Ledger script round trips, by script.", w=8),
            timeseries("Redis script calls",
                       [(f"sum by (script) ({rate('sandpool_redis_script_duration_seconds_count')})", "{{script}}")],
                       "ops", "Ledger script calls per second, by script.", w=8, stack=True),
            timeseries("Redis errors",
                       [(f"sum by (script) ({rate('sandpool_redis_errors_total')})", "{{script}}")], "ops",
                       "Ledger calls that failed (Redis down, timed out after 2 s, or a script error): callers "
                       "get 503.", w=8, bars=True),
            timeseries("Docker call latency p99",
                       [(quantile(0.99, "sandpool_docker_call_duration_seconds", ["op"]), "{{op}}")], "s",
                       "Docker API calls by operation (every call is bounded: 60 s, file transfers 120 s).", w=8),
            timeseries("Docker errors",
                       [(f"sum by (op) ({rate('sandpool_docker_errors_total')})", "{{op}}")], "ops",
                       "Docker API calls that failed or timed out, by operation.", w=8, bars=True),
            timeseries("Agent reattaches",
                       [(f"sum by (node) (increase({q('sandpool_agent_reattaches_total', N)}[{RI}]))", "{{node}}")],
                       "short", "Agent channels reattached after a pool-manager restart (one per surviving "
                       "sandbox).", w=8, bars=True),
        ],
    )


DASHBOARDS = {
    "overview.json": overview,
    "pools.json": pools,
    "tenants.json": tenants,
    "exec.json": exec_,
}


def render(build):
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv):
    check = "--check" in argv[1:]
    unknown = [a for a in argv[1:] if a != "--check"]
    if unknown:
        print(__doc__, file=sys.stderr)
        return 2
    stale = []
    for name, build in DASHBOARDS.items():
        path = os.path.join(HERE, name)
        want = render(build)
        try:
            with open(path, encoding="utf-8") as f:
                have = f.read()
        except FileNotFoundError:
            have = None
        if have == want:
            continue
        if check:
            stale.append(name)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(want)
            print(f"wrote dashboards/{name}")
    if stale:
        print("dashboards out of date with dashboards/gen.py: " + ", ".join(stale)
              + " (run: python3 dashboards/gen.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
