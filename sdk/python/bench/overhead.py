"""What the SDK adds to an exec round trip: `sb.commands.run(["true"])` alternated with the
same exec as a raw `httpx` POST on one kept connection, in one process, so both see the same
machine at the same moment. Prints p50/p90 of each and the difference of the medians.

    SANDPOOL_URL=... SANDPOOL_TOKEN=... python3 sdk/python/bench/overhead.py [--n 500] [--template busybox]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandpool import Sandbox  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--template", default="busybox")
    args = ap.parse_args()
    url, token = os.environ["SANDPOOL_URL"].rstrip("/"), os.environ["SANDPOOL_TOKEN"]
    sdk, raw = [], []
    with Sandbox.create(args.template, max_wait=60) as sb, \
            httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}) as http:
        path = f"/v1/sessions/{sb.session_id}/exec"
        for _ in range(20):  # warm both connections
            sb.commands.run(["true"])
            http.post(path, json={"cmd": ["true"]}).json()
        for _ in range(args.n):
            t0 = time.perf_counter()
            sb.commands.run(["true"])
            sdk.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            r = http.post(path, json={"cmd": ["true"]})
            r.raise_for_status()
            r.json()
            raw.append((time.perf_counter() - t0) * 1000)
    for name, xs in (("sdk", sdk), ("raw", raw)):
        print(f"{name}: p50 {pct(xs, .5):.3f} ms  p90 {pct(xs, .9):.3f} ms  (n={len(xs)})")
    print(f"added by the SDK (p50): {statistics.median(sdk) - statistics.median(raw):+.3f} ms")


if __name__ == "__main__":
    main()
