"""The SDK against a live gateway (SANDPOOL_URL, SANDPOOL_TOKEN, SANDPOOL_TEMPLATE).

Run by `cargo test -p sandpool --test python_sdk`, which starts `sandpool up` on a test stack.
"""

import asyncio
import os
import time

import pytest

import sandpool
from sandpool import AsyncSandbox, Sandbox

TEMPLATE = os.environ.get("SANDPOOL_TEMPLATE", "bb")


def test_an_episode_runs_commands_files_and_a_shell():
    with Sandbox.create(TEMPLATE, labels={"job": "sdk"}, max_wait=60) as sb:
        assert sb.info.template == TEMPLATE and sb.info.labels == {"job": "sdk"}
        r = sb.commands.run("echo hi; echo oops >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "oops\n")
        assert sb.commands.run(["cat"], stdin="piped").stdout == "piped"
        assert sb.commands.run("echo $A; pwd", env={"A": "1"}, cwd="/tmp").stdout == "1\n/tmp\n"
        slow = sb.commands.run("sleep 5", timeout=0.3)
        assert slow.timed_out
        sb.files.write("notes/a.txt", "hello")
        assert sb.files.read_text("notes/a.txt") == "hello"
        assert sb.commands.run("cat /work/notes/a.txt").stdout == "hello"
        [entry] = sb.files.list("notes")
        assert (entry.name, entry.type, entry.size, entry.path) == ("a.txt", "file", 5, "/work/notes/a.txt")
        assert "notes" in [e.name for e in sb.files.list() if e.is_dir]
        sb.files.write("/tmp/bin.dat", bytes(range(256)))
        assert sb.files.read("/tmp/bin.dat") == bytes(range(256))
        sh = sb.shells.create("main")
        sh.run("cd /tmp && export X=42")
        out = sh.run("pwd; echo $X")
        assert (out.output, out.cwd) == ("/tmp\n42\n", "/tmp")
        assert [s.name for s in sb.shells.list()] == ["main"]
        assert sb.keepalive().session_id == sb.session_id
        assert sb.session_id in [s.session_id for s in Sandbox.list(label="job=sdk")]
        sb.pause()
        assert sb.commands.run("echo back").stdout == "back\n", "a call resumes a paused session"
        sid = sb.session_id
    with pytest.raises(sandpool.SessionGone) as gone:
        Sandbox.connect(sid)
    assert gone.value.status == 404 and "deleted" in gone.value.message


def test_directories_go_in_and_out(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "README").write_text("hi\n")
    with Sandbox.create(TEMPLATE, max_wait=60) as sb:
        assert sb.files.upload_dir(str(src), "proj") == 2
        assert sb.commands.run("cat proj/pkg/mod.py proj/README").stdout == "X = 1\nhi\n"
        sb.commands.run("echo made > proj/new.txt")
        dst = tmp_path / "back"
        sb.files.download_dir("proj", str(dst))
    names = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert names == ["README", "new.txt", "pkg/mod.py"], names
    assert (dst / "new.txt").read_text() == "made\n" and (dst / "pkg" / "mod.py").read_text() == "X = 1\n"


def test_a_command_streams_to_callbacks():
    seen_out, seen_err, stamps = [], [], []
    with Sandbox.create(TEMPLATE, max_wait=60) as sb:
        def out(data):
            seen_out.append(data)
            stamps.append(time.monotonic())

        r = sb.commands.run("for i in 1 2 3; do echo line$i; sleep 0.3; done; echo done >&2",
                            on_stdout=out, on_stderr=seen_err.append)
    assert "".join(seen_out) == "line1\nline2\nline3\n" == r.stdout
    assert "".join(seen_err) == "done\n" == r.stderr
    assert r.exit_code == 0
    assert len(stamps) >= 2 and stamps[-1] - stamps[0] > 0.4, "output arrived as it was printed"


def test_background_commands_take_stdin_and_can_be_killed():
    with Sandbox.create(TEMPLATE, max_wait=60) as sb:
        later = sb.commands.run("sleep 0.3; echo done", background=True)
        cat = sb.commands.run(["cat"], background=True)
        cat.send_stdin("typed ")
        cat.send_stdin("in")
        cat.close_stdin()
        assert cat.wait(10).stdout == "typed in"
        stuck = sb.commands.run("sleep 30", background=True)
        with pytest.raises(TimeoutError):
            stuck.wait(0.2)
        stuck.kill()
        assert stuck.wait(10).exit_code == 137
        later.close_stdin()
        assert later.wait(10).stdout == "done\n"

    async def main():
        async with await AsyncSandbox.create(TEMPLATE, max_wait=60) as sb:
            h = await sb.commands.run(["cat"], background=True, stdin="async in")
            await h.close_stdin()
            assert (await h.wait(10)).stdout == "async in"
            k = await sb.commands.run("sleep 30", background=True)
            await k.kill()
            assert (await k.wait(10)).exit_code == 137
            term = await sb.pty.create(rows=10, cols=40)
            await term.send_stdin("stty size; exit\n")
            assert "10 40" in (await term.wait(10)).stdout

    asyncio.run(main())


def test_a_terminal_types_resizes_and_ends():
    seen = []
    with Sandbox.create(TEMPLATE, max_wait=60) as sb:
        term = sb.pty.create(rows=24, cols=80, on_data=seen.append)
        term.send_stdin("stty size\n")
        deadline = time.monotonic() + 10
        while "24 80" not in "".join(seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        term.resize(30, 100)
        term.send_stdin("stty size; exit\n")
        r = term.wait(10)
    assert "24 80" in r.stdout and "30 100" in r.stdout, r.stdout
    assert "\r\n" in r.stdout, "a terminal's line endings"


def test_errors_are_exceptions_named_after_the_api_codes():
    with pytest.raises(sandpool.UnknownTemplate) as e:
        Sandbox.create("no-such-template")
    assert e.value.status == 400 and e.value.code == "unknown_template"
    with pytest.raises(sandpool.NotFound):
        Sandbox.connect("n0.00")
    with pytest.raises(sandpool.Unauthorized):
        Sandbox.create(TEMPLATE, token="not-a-token")
    with pytest.raises(sandpool.BadRequest):
        Sandbox.create(TEMPLATE, timeout=0)
    assert isinstance(sandpool.QuotaExceeded("x"), sandpool.SandpoolError)


def test_a_template_from_a_registry_image():
    """A corpus image in the local registry (scripts/corpus) becomes a template of its own."""
    import json as _json
    import pathlib
    import subprocess
    import tempfile
    import uuid

    prefix = f"sdk-{uuid.uuid4().hex[:10]}"
    out = pathlib.Path(tempfile.mkdtemp()) / "corpus.jsonl"
    root = pathlib.Path(__file__).resolve().parents[3]
    subprocess.run([str(root / "scripts/corpus"), "--count", "1", "--layer-kb", "4", "--repo-prefix", prefix,
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    image = _json.loads(out.read_text().splitlines()[0])
    t = sandpool.create_template(image["image"], name="sdk-task", memory_mb=64)
    try:
        assert t["image"] == image["ref"] and t["memory_mb"] == 64
        [pull] = sandpool.prefetch([t["name"]])
        assert pull["state"] in ("pulling", "present")
        with Sandbox.create(t["name"], max_wait=120) as sb:
            assert sb.commands.run("cat /task/id").stdout == image["image"] + "\n"
        r = sandpool.reserve({t["name"]: 1}, time.time() + 120, hold_s=5)  # created near then: after this test
        assert r["count"] == 1 and r["items"] == [{"template": t["name"], "count": 1}]
        with pytest.raises(sandpool.ImageNotFound):
            sandpool.create_template(image["image"].replace("task-0000", "missing"))
    finally:
        sandpool.delete_template(t["name"])
        subprocess.run(["docker", "rmi", "-f", image["ref"]], capture_output=True)
        subprocess.run(["curl", "-fsS", "-X", "DELETE",
                        f"http://{image['image'].split('/')[0]}/v2/{prefix}/task-0000/manifests/{image['digest']}"],
                       capture_output=True)
    with pytest.raises(sandpool.UnknownTemplate):
        Sandbox.create(t["name"])


def test_usage_shows_the_callers_chain():
    u = sandpool.usage()
    assert u["levels"][0]["path"] == u["path"]


def test_sixty_four_concurrent_async_sandboxes():
    async def episode(i):
        async with await AsyncSandbox.create(TEMPLATE, max_wait=180) as sb:
            await sb.files.write("n.txt", str(i))
            r = await sb.commands.run("cat n.txt; echo -n :; expr $(cat n.txt) \\* 2")
            sh = await sb.shells.create()
            await sh.run("cd /tmp")
            cwd = (await sh.run("pwd")).cwd
            return r.stdout, cwd

    async def main():
        return await asyncio.gather(*(episode(i) for i in range(64)))

    results = asyncio.run(main())
    assert [r[0] for r in results] == [f"{i}:{2 * i}\n" for i in range(64)]
    assert {r[1] for r in results} == {"/tmp"}


def test_async_streaming_and_errors():
    async def main():
        async with await AsyncSandbox.create(TEMPLATE, max_wait=60) as sb:
            chunks = []
            r = await sb.commands.run("echo a; sleep 0.2; echo b", on_stdout=chunks.append)
            assert "".join(chunks) == "ab\n".replace("ab", "a\nb") and r.exit_code == 0
            with pytest.raises(sandpool.NotFound):
                await sb.files.read("no/such/file")

    asyncio.run(main())


def test_the_rollout_example_runs_shortened():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "rl_rollout.py"
    template = os.environ.get("SANDPOOL_ROLLOUT_TEMPLATE", "debian")
    out = subprocess.run([sys.executable, str(example), "--template", template, "--episodes", "16", "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "16 episodes of 3 steps" in out.stdout and "mean reward 0.750" in out.stdout, out.stdout
    assert "run" in out.stdout and "p99 ms" in out.stdout


def test_a_server_in_the_sandbox_is_reached_on_its_port():
    """`python3 -m http.server` in a sandbox without network, through the gateway: with the
    token, and through a signed URL without one."""
    import httpx
    template = os.environ.get("SANDPOOL_ROLLOUT_TEMPLATE", "deb")
    with Sandbox.create(template, max_wait=60) as sb:
        sb.files.write("site/index.html", "served from the sandbox")
        sb.commands.run("cd site && python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &")
        url = sb.get_url(8000, "index.html")
        headers = {"authorization": f"Bearer {os.environ['SANDPOOL_TOKEN']}"}
        deadline = time.time() + 20
        while True:
            r = httpx.get(url, headers=headers)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert (r.status_code, r.text) == (200, "served from the sandbox")
        assert httpx.get(url).status_code == 401, "the plain URL needs the token"
        signed = sb.get_signed_url(8000, ttl=60)
        assert httpx.get(signed + "index.html").text == "served from the sandbox"
        with pytest.raises(sandpool.Forbidden):
            sb.get_signed_url(22)


def test_files_exist_move_and_go():
    with Sandbox.create(TEMPLATE, max_wait=60) as sb:
        assert not sb.files.exists("d")
        sb.files.make_dir("d/e")
        sb.files.make_dir("d/e")  # already there: fine
        assert sb.files.exists("d/e") and sb.files.exists("/work/d")
        sb.files.write("d/a.txt", "x")
        sb.files.rename("d/a.txt", "d/e/b.txt")
        assert not sb.files.exists("d/a.txt") and sb.files.read_text("d/e/b.txt") == "x"
        sb.files.write("d/c.txt", "y")
        with pytest.raises(sandpool.Conflict):
            sb.files.rename("d/c.txt", "d/e/b.txt")
        with pytest.raises(sandpool.Conflict):
            sb.files.make_dir("d/c.txt")
        with pytest.raises(sandpool.Conflict):
            sb.files.remove("d")
        with pytest.raises(sandpool.NotFound):
            sb.files.remove("d/none")
        with pytest.raises(sandpool.NotFound):
            sb.files.rename("d/none", "d/other")
        with pytest.raises(sandpool.InvalidPath):  # in a body: an HTTP client resolves `../` in a URL
            sb.files.rename("../../etc/passwd", "stolen")
        sb.files.remove("d/c.txt")
        sb.files.remove("d", recursive=True)
        assert not sb.files.exists("d")


def test_async_files_exist_move_and_go():
    async def main():
        async with await AsyncSandbox.create(TEMPLATE, max_wait=60) as sb:
            await sb.files.make_dir("/tmp/q/r")
            assert await sb.files.exists("/tmp/q/r")
            await sb.files.write("/tmp/q/f", "1")
            await sb.files.rename("/tmp/q/f", "/tmp/q/r/g")
            assert await sb.files.read_text("/tmp/q/r/g") == "1"
            with pytest.raises(sandpool.Conflict):
                await sb.files.remove("/tmp/q")
            await sb.files.remove("/tmp/q", recursive=True)
            assert not await sb.files.exists("/tmp/q")
            with pytest.raises(sandpool.NotFound):
                await sb.files.remove("/tmp/q")

    asyncio.run(main())
