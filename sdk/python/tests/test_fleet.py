"""The SDK at scale against a live gateway: listings a page at a time, ends by label, one
connection pool per process, retries while a gateway is unreachable, functions, and the
async client's parity with the sync one.
"""

import asyncio
import os
import socket
import threading
import time
import uuid

import httpx
import pytest

import sandpool
from sandpool import AsyncFunction, AsyncSandbox, Config, Function, FunctionError, Sandbox
from sandpool import _core, _http, aio

TEMPLATE = os.environ.get("SANDPOOL_TEMPLATE", "bb")


def test_the_sdk_is_the_installed_package():
    venv = os.environ.get("SANDPOOL_SDK_VENV")
    assert venv, "run by sandpool/tests/python_sdk.rs, from a fresh venv"
    assert sandpool.__file__.startswith(venv), sandpool.__file__


def test_sessions_page_by_page_and_end_by_label():
    job = f"job-{uuid.uuid4().hex[:8]}"
    label = f"job={job}"
    made = [Sandbox.create(TEMPLATE, labels={"job": job}, max_wait=60) for _ in range(3)]
    other = Sandbox.create(TEMPLATE, labels={"job": "else"}, max_wait=60)
    try:
        ids = [sb.session_id for sb in made]
        assert [s.session_id for s in Sandbox.iter(label=label, page_size=1)] == ids, "oldest first, every page"
        assert [s.session_id for s in Sandbox.list(label=label)] == ids
        assert [s.session_id for s in asyncio.run(AsyncSandbox.list(label=label))] == ids
        page = httpx.get(f"{made[0]._http.cfg.url}/v1/sessions", params={"label": label, "limit": 2},
                         headers=made[0]._http.cfg.headers).json()
        assert len(page["sessions"]) == 2 and page["next_cursor"]
        with pytest.raises(sandpool.BadRequest) as bad:
            list(Sandbox.iter(page_size=0))
        assert "limit" in bad.value.message
        with pytest.raises(sandpool.BadRequest) as bad:
            Sandbox.kill_all(label="no-equals-sign")
        assert "label" in bad.value.message
        assert Sandbox.kill_all(label=label) == 3
        assert asyncio.run(AsyncSandbox.kill_all(label=label)) == 0
        assert Sandbox.list(label=label) == []
        for sb in made:
            with pytest.raises(sandpool.SessionGone):
                sb.refresh()
        assert other.refresh().session_id == other.session_id, "another label's session goes on"
    finally:
        other.kill()


def test_every_call_of_the_process_shares_one_pool():
    with Sandbox.create(TEMPLATE, max_wait=60) as a, Sandbox.create(TEMPLATE, max_wait=60) as b:
        assert a._http.client is b._http.client
        reward = Function("anything")
        assert reward._http.client is a._http.client
        assert len([k for k in _http._sync if k[0] == a._http.cfg.url]) == 1

    async def main():
        async with await AsyncSandbox.create(TEMPLATE, max_wait=60) as x, \
                await AsyncSandbox.create(TEMPLATE, max_wait=60) as y:
            assert x._http.client is y._http.client
            return x._http.client

    first, second = asyncio.run(main()), asyncio.run(main())
    assert first is not second, "an async pool belongs to its event loop"


class _LateProxy:
    """A TCP forwarder to the gateway that starts listening only after `delay` seconds: a
    gateway restarting, as a client sees it (connections refused, then served)."""

    def __init__(self, upstream: str, delay: float) -> None:
        host, port = upstream.split("//")[1].split(":")
        self.upstream = (host, int(port))
        self.port = _free_port()
        self.server = None
        self.thread = threading.Thread(target=self._run, args=(delay,), daemon=True)
        self.thread.start()

    def _run(self, delay: float) -> None:
        time.sleep(delay)
        self.server = socket.create_server(("127.0.0.1", self.port))
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def test_a_refused_connection_is_retried_with_bounded_backoff():
    real = Config()
    proxy = _LateProxy(real.url, delay=0.5)
    try:
        cfg = Config(url=f"http://127.0.0.1:{proxy.port}")
        t0 = time.monotonic()
        assert isinstance(Sandbox.list(config=cfg), list), "answered once the gateway listens"
        assert time.monotonic() - t0 >= 0.4
    finally:
        proxy.close()
    # Nothing ever listens: the retries end, and the error is the connection's.
    t0 = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        Sandbox.list(config=Config(url=f"http://127.0.0.1:{_free_port()}", max_retries=3))
    assert time.monotonic() - t0 < 0.1 * (1 + 2 + 4) + 1, "bounded: three back-offs from 0.1 s"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_the_retry_policy():
    cfg = Config(max_retries=3)
    refused, reset = httpx.ConnectError("refused"), httpx.ReadError("reset")
    node = sandpool.NodeUnavailable("node n1 is unavailable", status=503)
    quota = sandpool.QuotaExceeded("full", status=429)
    busy = sandpool.TooManyRequests("busy", status=429, retry_after=2.0)
    assert _core.retry_delay(refused, 0, cfg, idempotent=False) is not None, "the request never left"
    assert _core.retry_delay(reset, 0, cfg, idempotent=False) is None, "a create may have happened"
    assert _core.retry_delay(reset, 0, cfg, idempotent=True) is not None
    assert _core.retry_delay(node, 0, cfg, idempotent=True) is not None
    assert _core.retry_delay(node, 0, cfg, idempotent=False) is None
    assert _core.retry_delay(quota, 0, cfg, idempotent=True) is None, "a quota does not free itself"
    assert 2.0 <= _core.retry_delay(busy, 0, cfg, idempotent=True) <= 2.2
    assert _core.retry_delay(httpx.ReadTimeout("slow"), 0, cfg, idempotent=True) is None
    assert _core.retry_delay(refused, 3, cfg, idempotent=True) is None, "bounded by max_retries"
    delays = [_core.retry_delay(refused, i, cfg, idempotent=True) for i in range(3)]
    assert all(0.05 * 2 ** i <= d <= 0.1 * 2 ** i for i, d in enumerate(delays)), delays


# Exec mode: the payload on stdin, stdout the result; "fail" exits 3 (a function error).
DOUBLE = ["sh", "-c", 'read -r x; [ "$x" = \'"fail"\' ] && { echo broken >&2; exit 3; }; echo $((x * 2))']


def test_functions_invoke_map_and_collect_results():
    name = f"dbl-{uuid.uuid4().hex[:8]}"
    f = Function.deploy(name, template=TEMPLATE, mode="exec", handler=DOUBLE, timeout_ms=20000)
    try:
        assert f.invoke(21) == 42
        assert f.invoke(b"5", raw=True) == b"10\n"
        with pytest.raises(FunctionError) as e:
            f.invoke("fail")
        assert e.value.function_error == "unhandled"
        assert list(f.map([1, 2, 3])) == [2, 4, 6]
        out = list(f.map([1, "fail", 3], return_exceptions=True))
        assert out[0] == 2 and isinstance(out[1], FunctionError) and out[2] == 6
        with pytest.raises(FunctionError):
            list(f.map([1, "fail"]))
        ids = [f.invoke_async(n) for n in (4, 5)]
        assert [f.result(i, timeout=60) for i in ids] == [8, 10]
        with pytest.raises(FunctionError):
            f.result(f.invoke_async("fail"), timeout=60)
        assert name in [d["name"] for d in Function.list()]
        assert f.info()["mode"] == "exec"

        async def main():
            af = AsyncFunction(name)
            assert await af.invoke(7) == 14
            assert [r async for r in af.map([1, 2])] == [2, 4]
            assert await af.result(await af.invoke_async(9), timeout=60) == 18
            assert name in [d["name"] for d in await AsyncFunction.list()]

        asyncio.run(main())
    finally:
        f.delete()
    with pytest.raises(sandpool.NotFound):
        Function(name).invoke(1)


def test_the_async_client_has_the_sync_surface():
    sync_names = {n for n in dir(Sandbox) if not n.startswith("_")}
    async_names = {n for n in dir(AsyncSandbox) if not n.startswith("_")}
    assert sync_names <= async_names, sync_names - async_names
    fn_names = {n for n in dir(Function) if not n.startswith("_")}
    assert fn_names <= {n for n in dir(AsyncFunction) if not n.startswith("_")}
    for call in ("usage", "create_template", "delete_template", "prefetch", "reserve", "list_templates"):
        assert asyncio.iscoroutinefunction(getattr(aio, call)), call

    async def main():
        u = await aio.usage()
        assert u["levels"][0]["path"] == u["path"]
        assert TEMPLATE in [t["name"] for t in await aio.list_templates()]
        async with await AsyncSandbox.create(TEMPLATE, max_wait=60) as sb:
            assert (await sb.refresh()).session_id == sb.session_id
            assert sb.session_id in [s.session_id for s in await AsyncSandbox.list()]

    asyncio.run(main())
    assert TEMPLATE in [t["name"] for t in sandpool.list_templates()]
