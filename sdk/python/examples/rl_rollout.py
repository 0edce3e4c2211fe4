"""64 concurrent SWE-style RL episodes with asyncio on the Debian template: each opens a
sandbox, is given a tiny Python repository with a failing unit test, takes a few steps (run
the tests, read the code, patch a file, run them again) and is rewarded by the tests
themselves, run inside the sandbox. Prints a summary and per-step latency percentiles.

The burst is reserved ahead (`sandpool.reserve`): a training loop knows its next step's size
and time, and a pool sized for steady traffic (the default config keeps 2 Debian sandboxes
warm) cannot meet 64 creates at once; declared ahead, the autoscaler has them idle by then,
and every episode starts warm in under a millisecond instead of waiting seconds for a cold
create. `--reserve-lead-s 0` runs the burst unannounced, to see the difference.

    pip install ./sdk/python     # then:
    SANDPOOL_URL=... SANDPOOL_TOKEN=... python3 examples/rl_rollout.py --template debian

(`sandpool/tests/python_sdk.rs` runs it shortened on a Debian template.)
"""

import argparse
import asyncio
import calendar
import random
import statistics
import sys
import time
from collections import defaultdict

from sandpool import AsyncSandbox, reserve

STEP_LATENCIES = defaultdict(list)
# How each episode's sandbox started: "warm" (it was idle) or "cold" (created for it).
STARTS = defaultdict(int)


async def timed(kind, coro):
    t0 = time.perf_counter()
    try:
        return await coro
    finally:
        STEP_LATENCIES[kind].append((time.perf_counter() - t0) * 1000)


# The task: `stats.mean` is wrong (an off-by-one); `test_stats.py` says so.
REPO = {
    "stats.py": "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n",
    "test_stats.py": (
        "import unittest\nfrom stats import mean\n\n"
        "class T(unittest.TestCase):\n"
        "    def test_mean(self):\n        self.assertEqual(mean([{a}, {b}, {c}]), {m})\n\n"
        "if __name__ == '__main__':\n    unittest.main()\n"
    ),
}
FIXED = "def mean(xs):\n    return sum(xs) / len(xs)\n"
WRONG = "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n"


async def episode(i, template, steps):
    rng = random.Random(i)
    a, b, c = (rng.randint(1, 30) * 3 for _ in range(3))
    t0 = time.perf_counter()
    async with await timed("create", AsyncSandbox.create(template, labels={"rollout": str(i)}, max_wait=300)) as sb:
        STARTS[sb.info.start] += 1
        # The gateway's part of the create (request to grant, queue wait included): "create"
        # above adds the client's side (its HTTP client, the round trip).
        STEP_LATENCIES["grant"].append(sb.info.wait_ms)
        for name, text in REPO.items():
            await timed("write", sb.files.write(f"repo/{name}", text.format(a=a, b=b, c=c, m=(a + b + c) / 3)))
        shell = await timed("shell", sb.shells.create())
        await timed("run", shell.run("cd repo"))
        # The "policy": look around, run the tests, read the code; then patch (every fourth
        # episode patches wrongly, so rewards differ).
        for step in range(steps):
            cmd = ["ls", "python3 -m unittest -q 2>&1 | tail -n 1", "cat stats.py"][step % 3]
            await timed("run", shell.run(cmd))
        listing = await timed("list", sb.files.list("repo"))
        assert {e.name for e in listing} >= set(REPO), listing
        await timed("write", sb.files.write("repo/stats.py", WRONG if i % 4 == 0 else FIXED))
        # The reward, computed in the sandbox: the tests pass or they do not.
        r = await timed("exec", sb.commands.run(["python3", "-m", "unittest", "-q"], cwd="repo"))
        reward = 1 if r.exit_code == 0 else 0
    return {"episode": i, "reward": reward, "seconds": time.perf_counter() - t0}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


async def reserve_burst(template, episodes, lead_s):
    """Declares the burst `lead_s` ahead and waits for that moment: by then the autoscaler has
    `episodes` sandboxes idle (`feasible` says whether the nodes' create rate allows it; if
    not, the burst waits until `earliest_ready_at`)."""
    ready_by = time.time() + lead_s
    r = await asyncio.to_thread(reserve, {template: episodes}, ready_by, hold_s=120)
    if not r["feasible"]:
        print(f"reservation: {episodes} x {template!r} not idle before {r['earliest_ready_at']}; waiting for it")
        ready_by = max(ready_by, calendar.timegm(time.strptime(r["earliest_ready_at"][:19], "%Y-%m-%dT%H:%M:%S")))
    print(f"reserved {episodes} x {template!r} for {time.strftime('%H:%M:%S', time.localtime(ready_by))}")
    await asyncio.sleep(max(0.0, ready_by - time.time()))


async def main(args):
    if args.reserve_lead_s > 0:
        await reserve_burst(args.template, args.episodes, args.reserve_lead_s)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(episode(i, args.template, args.steps) for i in range(args.episodes)))
    wall = time.perf_counter() - t0
    rewards = [r["reward"] for r in results]
    print(f"{args.episodes} episodes of {args.steps} steps on {args.template!r} in {wall:.1f} s; "
          f"mean reward {statistics.mean(rewards):.3f}")
    print(f"sandboxes: {STARTS['warm']} warm, {STARTS['cold']} cold")
    print(f"{'step':<8}{'n':>6}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for kind, xs in sorted(STEP_LATENCIES.items()):
        print(f"{kind:<8}{len(xs):>6}{pct(xs, .5):>10.2f}{pct(xs, .9):>10.2f}{pct(xs, .99):>10.2f}")
    return rewards


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", default="debian")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reserve-lead-s", type=float, default=30,
                    help="reserve the burst this many seconds ahead, then start it (0: no reservation)")
    rewards = asyncio.run(main(ap.parse_args()))
    # Every fourth episode answers wrong on purpose: the rewards say so.
    expected = [0 if i % 4 == 0 else 1 for i in range(len(rewards))]
    sys.exit(0 if rewards == expected else 1)
