"""What the SDK adds to a round trip over raw `httpx` on one kept connection, in one process,
alternating the two so both see the same machine at the same moment:

- `exec`: `sb.commands.run(["true"])` against a raw POST of the same exec;
- `create`: `Sandbox.create(t, session_key=k)` against a raw POST of the same create: the
  gateway answers the one live session of that key every time, so the pool's refill (slow on
  a loaded machine) stays out of the figures;
- `client` (only with `--only client`, no gateway needed): the client's own work per create,
  against an in-process `httpx.MockTransport`;
- `fresh` (only with `--only fresh`): creates of new sessions, each ended untimed; pairs where
  a side waited for a sandbox are left out and counted.

Prints p50/p90 of each side and the difference of the medians.

    pip install ./sdk/python
    SANDPOOL_URL=... SANDPOOL_TOKEN=... python3 sdk/python/bench/overhead.py [--n 500] [--template busybox] [--only create]
"""

import argparse
import os
import statistics
import time
import uuid

import httpx

from sandpool import Sandbox


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


def report(what, sdk, raw):
    for name, xs in (("sdk", sdk), ("raw", raw)):
        print(f"{what} {name}: p50 {pct(xs, .5):.3f} ms  p90 {pct(xs, .9):.3f} ms  (n={len(xs)})")
    print(f"{what}: added by the SDK (p50): {statistics.median(sdk) - statistics.median(raw):+.3f} ms")


def bench_exec(http, template, n):
    sdk, raw = [], []
    with Sandbox.create(template, max_wait=60) as sb:
        path = f"/v1/sessions/{sb.session_id}/exec"
        for _ in range(20):  # warm both connections
            sb.commands.run(["true"])
            http.post(path, json={"cmd": ["true"]}).json()
        for _ in range(n):
            t0 = time.perf_counter()
            sb.commands.run(["true"])
            sdk.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            r = http.post(path, json={"cmd": ["true"]})
            r.raise_for_status()
            r.json()
            raw.append((time.perf_counter() - t0) * 1000)
    report("exec", sdk, raw)


def bench_create(http, template, n, pause):
    """Creates with one `session_key`: the gateway answers the same live session every time
    (the whole create path: auth, admission, the ledger's lookup), so no sandbox is consumed
    and the pool's refill cannot enter the figures on a loaded machine."""
    key = f"bench-{uuid.uuid4().hex}"
    body = {"template": template, "max_wait_s": 60, "session_key": key}

    def raw_create():
        t0 = time.perf_counter()
        r = http.post("/v1/sessions", json=body)
        r.raise_for_status()
        r.json()
        return (time.perf_counter() - t0) * 1000

    def sdk_create():
        t0 = time.perf_counter()
        Sandbox.create(template, max_wait=60, session_key=key)
        return (time.perf_counter() - t0) * 1000

    first = Sandbox.create(template, max_wait=60, session_key=key)
    try:
        for _ in range(20):  # warm both connections (and the SDK's shared pool)
            raw_create()
            sdk_create()
        sdk, raw = [], []
        for _ in range(n):
            sdk.append(sdk_create())
            raw.append(raw_create())
        report("create", sdk, raw)
    finally:
        first.kill()


def bench_fresh_create(http, template, n, pause):
    """Creates of new sessions (each ended, untimed, right after); pairs where either side had
    to wait for a sandbox (`start` not `warm`) are left out and counted."""

    def raw_create():
        t0 = time.perf_counter()
        r = http.post("/v1/sessions", json={"template": template, "max_wait_s": 60})
        r.raise_for_status()
        took = (time.perf_counter() - t0) * 1000
        body = r.json()
        http.delete(f"/v1/sessions/{body['session_id']}").raise_for_status()
        return took, body["start"]

    def sdk_create():
        t0 = time.perf_counter()
        sb = Sandbox.create(template, max_wait=60)
        took = (time.perf_counter() - t0) * 1000
        sb.kill()
        return took, sb.info.start

    sdk, raw, cold = [], [], 0
    for _ in range(n):
        time.sleep(pause)  # untimed: lets the pool refill what the last pair took
        (s, s_start), (r, r_start) = sdk_create(), raw_create()
        if s_start == r_start == "warm":
            sdk.append(s)
            raw.append(r)
        else:
            cold += 1  # a pair that waited for a sandbox measures the pool, not the client
    print(f"fresh create: {cold} of {n} pairs left out (a side started cold)")
    if sdk:
        report("fresh create", sdk, raw)


def bench_client(n):
    """The client's own work per create, with no server and no network: the SDK and raw
    `httpx` against the same in-process transport (`httpx.MockTransport`) answering a canned
    session. On a loaded machine the live figures' noise is larger than the SDK's cost; this
    one is not."""
    import json

    from sandpool import Config, _http

    answer = json.dumps({"session_id": "n1.ab", "sandbox_id": "n1.cd", "node": "n1", "template": "busybox",
                         "start": "warm", "wait_ms": 1.0, "expires_at": "", "max_expires_at": "",
                         "created_at": "", "labels": {}}).encode()
    transport = httpx.MockTransport(lambda req: httpx.Response(201, content=answer,
                                                               headers={"content-type": "application/json"}))
    cfg = Config(url="http://bench.invalid", token="t")
    _http._sync[(cfg.url, False)] = httpx.Client(base_url=cfg.url, transport=transport)
    raw_http = httpx.Client(base_url=cfg.url, transport=transport, headers={"authorization": "Bearer t"})

    def raw():
        t0 = time.perf_counter()
        r = raw_http.post("/v1/sessions", json={"template": "busybox", "max_wait_s": 60})
        r.raise_for_status()
        r.json()
        return (time.perf_counter() - t0) * 1000

    def sdk():
        t0 = time.perf_counter()
        Sandbox.create("busybox", max_wait=60, config=cfg)
        return (time.perf_counter() - t0) * 1000

    for _ in range(200):
        raw()
        sdk()
    a, b = [], []
    for _ in range(n):
        a.append(sdk())
        b.append(raw())
    report("client-only create", a, b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--template", default="busybox")
    ap.add_argument("--only", choices=["exec", "create", "fresh", "client"])
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between create pairs (untimed)")
    args = ap.parse_args()
    if args.only == "client":
        return bench_client(args.n)
    url, token = os.environ["SANDPOOL_URL"].rstrip("/"), os.environ["SANDPOOL_TOKEN"]
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}) as http:
        if args.only in (None, "exec"):
            bench_exec(http, args.template, args.n)
        if args.only in (None, "create"):
            bench_create(http, args.template, args.n, args.pause)
        if args.only == "fresh":
            bench_fresh_create(http, args.template, args.n, args.pause)


if __name__ == "__main__":
    main()
