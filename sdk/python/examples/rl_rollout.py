"""64 concurrent RL-style episodes with asyncio: each opens a sandbox, does a few steps of
commands and file edits (a toy task: make `answer.txt` hold the sum of the numbers in
`task.txt`), and has its reward computed inside the sandbox. Prints a summary and per-step
latency percentiles.

    SANDPOOL_URL=... SANDPOOL_TOKEN=... python3 examples/rl_rollout.py --template debian

(`sandpool/tests/python_sdk.rs` runs it shortened on the busybox template.)
"""

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandpool import AsyncSandbox  # noqa: E402

STEP_LATENCIES = defaultdict(list)


async def timed(kind, coro):
    t0 = time.perf_counter()
    try:
        return await coro
    finally:
        STEP_LATENCIES[kind].append((time.perf_counter() - t0) * 1000)


async def episode(i, template, steps):
    rng = random.Random(i)
    numbers = [rng.randint(1, 100) for _ in range(5)]
    t0 = time.perf_counter()
    async with await timed("create", AsyncSandbox.create(template, labels={"rollout": str(i)}, max_wait=300)) as sb:
        await timed("write", sb.files.write("task.txt", " ".join(map(str, numbers)) + "\n"))
        shell = await timed("shell", sb.shells.create())
        await timed("run", shell.run("mkdir -p work && cd work"))
        # The "policy": a few steps of commands, the last one writes the answer (an off-by-one
        # in some episodes, so rewards differ).
        total = 0
        for step in range(steps):
            r = await timed("run", shell.run(f"cat ../task.txt | tr ' ' '\\n' | head -n {step + 1} | tail -n 1"))
            total += int(r.output.strip() or 0)
        guess = sum(numbers) if i % 4 else sum(numbers) + 1
        await timed("write", sb.files.write("work/answer.txt", f"{guess}\n"))
        # The reward, computed in the sandbox: 1 if the answer is the sum, else 0.
        r = await timed("exec", sb.commands.run(
            "s=0; for n in $(cat task.txt); do s=$((s+n)); done; [ \"$(cat work/answer.txt)\" = \"$s\" ] && echo 1 || echo 0"))
        reward = int(r.stdout.strip())
    return {"episode": i, "reward": reward, "partial": total, "seconds": time.perf_counter() - t0}


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
