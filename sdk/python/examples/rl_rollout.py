"""64 concurrent SWE-style RL episodes with asyncio on the Debian template: each opens a
sandbox, is given a tiny Python repository with a failing unit test, takes a few steps (run
the tests, read the code, patch a file, run them again) and is rewarded by the tests
themselves, run inside the sandbox. Prints a summary and per-step latency percentiles.

    pip install ./sdk/python     # then:
    SANDPOOL_URL=... SANDPOOL_TOKEN=... python3 examples/rl_rollout.py --template debian

(`sandpool/tests/python_sdk.rs` runs it shortened on a Debian template.)
"""

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import defaultdict

from sandpool import AsyncSandbox

STEP_LATENCIES = defaultdict(list)


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


async def main(args):
    t0 = time.perf_counter()
    results = await asyncio.gather(*(episode(i, args.template, args.steps) for i in range(args.episodes)))
    wall = time.perf_counter() - t0
    rewards = [r["reward"] for r in results]
    print(f"{args.episodes} episodes of {args.steps} steps on {args.template!r} in {wall:.1f} s; "
          f"mean reward {statistics.mean(rewards):.3f}")
    print(f"{'step':<8}{'n':>6}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for kind, xs in sorted(STEP_LATENCIES.items()):
        print(f"{kind:<8}{len(xs):>6}{pct(xs, .5):>10.2f}{pct(xs, .9):>10.2f}{pct(xs, .99):>10.2f}")
    return rewards


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", default="debian")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    rewards = asyncio.run(main(ap.parse_args()))
    # Every fourth episode answers wrong on purpose: the rewards say so.
    expected = [0 if i % 4 == 0 else 1 for i in range(len(rewards))]
    sys.exit(0 if rewards == expected else 1)
