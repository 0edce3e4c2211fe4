"""The asynchronous client: `AsyncSandbox`, the same surface as `Sandbox` with `await`."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import httpx

from . import _core
from ._core import Cmd, CommandResult, Config, EntryInfo, SessionInfo, ShellInfo, ShellResult
from ._http import AsyncHttp
from .errors import SandpoolError


class AsyncCommands:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def run(self, cmd: Cmd, *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                  timeout: Optional[float] = None, stdin: Optional[str] = None,
                  on_stdout: Optional[Callable[[str], Any]] = None,
                  on_stderr: Optional[Callable[[str], Any]] = None, background: bool = False) -> Any:
        if background:
            return await AsyncCommandHandle.start(self._sb, cmd, env, cwd, timeout, stdin, on_stdout, on_stderr)
        if on_stdout is None and on_stderr is None:
            r = await self._sb._http.call("POST", _core.session_path(self._sb.session_id, "/exec"),
                                          body=_core.exec_body(cmd, env, cwd, timeout, stdin),
                                          timeout=(timeout or 300) + 30)
            return CommandResult.parse(r.json())
        from websockets.asyncio.client import connect

        cfg = self._sb._http.cfg
        url = cfg.ws_url + _core.session_path(self._sb.session_id, "/ws")
        cid = uuid.uuid4().hex
        collected = _core.Streamed(cid, on_stdout, on_stderr)
        async with connect(url, additional_headers=cfg.headers, open_timeout=cfg.timeout) as ws:
            await ws.send(json.dumps(_core.start_message(cid, cmd, env, cwd, timeout)))
            if stdin:
                await ws.send(json.dumps({"type": "stdin", "id": cid, "data": stdin}))
            await ws.send(json.dumps({"type": "stdin_eof", "id": cid}))
            while True:
                result = collected.feed(json.loads(await ws.recv()))
                if result is not None:
                    return result


class AsyncCommandHandle:
    """A command running in the background over the session WebSocket (`await handle.wait()`)."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self._ws: Any = None
        self._task: Any = None

    @classmethod
    async def start(cls, sb: "AsyncSandbox", cmd: Cmd, env: Any, cwd: Any, timeout: Any, stdin: Optional[str],
                    on_stdout: Any, on_stderr: Any,
                    pty: Optional[Mapping[str, int]] = None) -> "AsyncCommandHandle":
        from websockets.asyncio.client import connect

        h = cls()
        cfg = sb._http.cfg
        h._ws = await connect(cfg.ws_url + _core.session_path(sb.session_id, "/ws"), additional_headers=cfg.headers,
                              open_timeout=cfg.timeout)
        collected = _core.Streamed(h.id, on_stdout, on_stderr)
        await h._ws.send(json.dumps(_core.start_message(h.id, cmd, env, cwd, timeout, pty)))
        if stdin:
            await h.send_stdin(stdin)

        async def read() -> CommandResult:
            while True:
                result = collected.feed(json.loads(await h._ws.recv()))
                if result is not None:
                    return result

        h._task = asyncio.ensure_future(read())
        return h

    async def send_stdin(self, data: str) -> None:
        await self._ws.send(json.dumps({"type": "stdin", "id": self.id, "data": data}))

    async def close_stdin(self) -> None:
        await self._ws.send(json.dumps({"type": "stdin_eof", "id": self.id}))

    async def resize(self, rows: int, cols: int) -> None:
        await self._ws.send(json.dumps({"type": "resize", "id": self.id, "rows": rows, "cols": cols}))

    async def kill(self, signal: int = 9) -> None:
        await self._ws.send(json.dumps({"type": "signal", "id": self.id, "signal": signal}))

    async def wait(self, timeout: Optional[float] = None) -> CommandResult:
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), timeout)
        finally:
            if self._task.done():
                await self._ws.close()


class AsyncPty:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def create(self, rows: int = 24, cols: int = 80, *, cmd: Cmd = ("sh",),
                     env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                     timeout: Optional[float] = 3600,
                     on_data: Optional[Callable[[str], Any]] = None) -> AsyncCommandHandle:
        return await AsyncCommandHandle.start(self._sb, list(cmd), env, cwd, timeout, None, on_data, None,
                                              pty={"rows": rows, "cols": cols})


class AsyncFiles:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def write(self, path: str, data: Union[bytes, str]) -> None:
        content = data.encode() if isinstance(data, str) else data
        await self._sb._http.call("PUT", _core.file_path(self._sb.session_id, path), content=content, timeout=300)

    async def read(self, path: str) -> bytes:
        r = await self._sb._http.call("GET", _core.file_path(self._sb.session_id, path), retry=True, timeout=300)
        return r.content

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode()

    async def list(self, path: str = ".") -> List[EntryInfo]:
        r = await self._sb._http.call("GET", _core.dir_path(self._sb.session_id, path), retry=True)
        return _core.entries(r.json())

    async def exists(self, path: str) -> bool:
        r = await self._sb._http.call("GET", _core.exists_path(self._sb.session_id, path), retry=True)
        return bool(r.json()["exists"])

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        params = {"recursive": "true"} if recursive else None
        await self._sb._http.call("DELETE", _core.file_path(self._sb.session_id, path), params=params)

    async def rename(self, old_path: str, new_path: str) -> None:
        await self._sb._http.call("POST", _core.rename_path(self._sb.session_id),
                                  body={"from": old_path, "to": new_path})

    async def make_dir(self, path: str) -> None:
        await self._sb._http.call("POST", _core.dir_path(self._sb.session_id, path), retry=True)

    async def upload_dir(self, local_dir: str, remote_dir: str) -> int:
        n = 0
        for src, rel in _core.walk_files(local_dir):
            with open(src, "rb") as f:
                await self.write(_core.join_remote(remote_dir, rel), f.read())
            n += 1
        return n

    async def download_dir(self, remote_dir: str, local_dir: str) -> None:
        _core.extract_tar(await self.read(remote_dir), local_dir)


class AsyncShell:
    def __init__(self, sb: "AsyncSandbox", info: Mapping[str, Any]) -> None:
        self._sb = sb
        self.name: str = info["name"]
        self.shell: str = info.get("shell", "sh")

    def _path(self, rest: str = "") -> str:
        return _core.session_path(self._sb.session_id, f"/shells/{self.name}{rest}")

    async def run(self, cmd: str, *, timeout: Optional[float] = None, stdin: Optional[str] = None) -> ShellResult:
        r = await self._sb._http.call("POST", self._path("/run"), body=_core.shell_run_body(cmd, timeout, stdin),
                                      timeout=(timeout or 300) + 45)
        return ShellResult.parse(r.json())

    async def interrupt(self) -> None:
        await self._sb._http.call("POST", self._path("/interrupt"))

    async def close(self) -> None:
        await self._sb._http.call("DELETE", self._path(), retry=True)


class AsyncShells:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def create(self, name: Optional[str] = None, *, shell: Optional[str] = None,
                     env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> AsyncShell:
        r = await self._sb._http.call("POST", _core.session_path(self._sb.session_id, "/shells"),
                                      body=_core.shell_create_body(name, shell, env, cwd))
        return AsyncShell(self._sb, r.json())

    async def list(self) -> List[ShellInfo]:
        r = await self._sb._http.call("GET", _core.session_path(self._sb.session_id, "/shells"), retry=True)
        return [ShellInfo.parse(s) for s in r.json()["shells"]]


class AsyncSandbox:
    """`async with await AsyncSandbox.create("busybox") as sb:` deletes the session on exit."""

    def __init__(self, info: SessionInfo, http: AsyncHttp) -> None:
        self.info = info
        self.session_id = info.session_id
        self._http = http
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.shells = AsyncShells(self)
        self.pty = AsyncPty(self)

    @classmethod
    async def create(cls, template: str, *, timeout: Optional[int] = None, idle_timeout: Optional[int] = None,
                     labels: Optional[Mapping[str, str]] = None, session_key: Optional[str] = None,
                     max_wait: Optional[float] = None, url: str = "", token: str = "",
                     config: Optional[Config] = None) -> "AsyncSandbox":
        http = AsyncHttp(config or Config(url=url, token=token))
        body = _core.create_body(template, timeout, idle_timeout, labels, session_key, max_wait)
        wait = (max_wait if max_wait is not None else 30) + http.cfg.timeout
        r = await http.call("POST", "/v1/sessions", body=body, retry=session_key is not None, timeout=wait)
        return cls(SessionInfo.parse(r.json()), http)

    @classmethod
    async def connect(cls, session_id: str, *, url: str = "", token: str = "",
                      config: Optional[Config] = None) -> "AsyncSandbox":
        http = AsyncHttp(config or Config(url=url, token=token))
        r = await http.call("GET", _core.session_path(session_id), retry=True)
        return cls(SessionInfo.parse(r.json()), http)

    @staticmethod
    async def list(*, subtree: bool = False, label: Optional[str] = None, url: str = "", token: str = "",
                   config: Optional[Config] = None) -> List[SessionInfo]:
        """The caller's live sessions, oldest first, every page of them (as `Sandbox.list`)."""
        return [s async for s in AsyncSandbox.iter(subtree=subtree, label=label,
                                                   config=config or Config(url=url, token=token))]

    @staticmethod
    async def iter(*, subtree: bool = False, label: Optional[str] = None, page_size: Optional[int] = None,
                   url: str = "", token: str = "", config: Optional[Config] = None) -> AsyncIterator[SessionInfo]:
        http = AsyncHttp(config or Config(url=url, token=token))
        cursor: Optional[str] = None
        while True:
            params = _core.list_params(subtree, label, page_size, cursor)
            page = (await http.call("GET", "/v1/sessions", params=params, retry=True)).json()
            for s in page["sessions"]:
                yield SessionInfo.parse(s)
            cursor = page.get("next_cursor")
            if not cursor:
                return

    @staticmethod
    async def kill_all(*, label: str, subtree: bool = False, url: str = "", token: str = "",
                       config: Optional[Config] = None) -> int:
        """Ends every live session of the caller with `label` in one call; how many ended."""
        http = AsyncHttp(config or Config(url=url, token=token))
        params = {"label": label, "subtree": "true" if subtree else "false"}
        return int((await http.call("DELETE", "/v1/sessions", params=params, retry=True)).json()["ended"])

    async def refresh(self) -> SessionInfo:
        r = await self._http.call("GET", _core.session_path(self.session_id), retry=True)
        self.info = SessionInfo.parse(r.json())
        return self.info

    async def keepalive(self) -> SessionInfo:
        r = await self._http.call("POST", _core.session_path(self.session_id, "/keepalive"), retry=True)
        self.info = SessionInfo.parse(r.json())
        return self.info

    async def pause(self) -> None:
        await self._http.call("POST", _core.session_path(self.session_id, "/pause"), retry=True)

    async def set_egress(self, policy: str) -> SessionInfo:
        r = await self._http.call("PUT", _core.session_path(self.session_id, "/egress"), body={"policy": policy},
                                  retry=True)
        self.info = SessionInfo.parse(r.json())
        return self.info

    async def resume(self) -> None:
        await self._http.call("POST", _core.session_path(self.session_id, "/resume"), retry=True)

    async def snapshot(self) -> str:
        r = await self._http.call("POST", _core.session_path(self.session_id, "/snapshot"), timeout=330)
        return r.json()["template"]

    async def fork(self, n: int) -> List["AsyncSandbox"]:
        r = await self._http.call("POST", _core.session_path(self.session_id, "/fork"), body={"count": n},
                                  timeout=400)
        return [AsyncSandbox(SessionInfo.parse(s), AsyncHttp(self._http.cfg)) for s in r.json()["sessions"]]

    def get_url(self, port: int, path: str = "") -> str:
        """The URL of `port` in the sandbox through the gateway (see `Sandbox.get_url`)."""
        return f"{self._http.cfg.url}{_core.session_path(self.session_id)}/ports/{int(port)}/{path.lstrip('/')}"

    async def get_signed_url(self, port: int, *, ttl: int = 600) -> str:
        """A URL of `port` that works without a token for `ttl` seconds (see
        `Sandbox.get_signed_url`)."""
        r = await self._http.call("POST", _core.session_path(self.session_id, "/urls"),
                                  body={"port": port, "ttl_s": ttl}, retry=True)
        return f"{self._http.cfg.url}{r.json()['path']}"

    async def kill(self) -> None:
        try:
            await self._http.call("DELETE", _core.session_path(self.session_id), retry=True)
        except SandpoolError as e:
            if e.code not in ("session_gone", "not_found"):
                raise

    async def close(self) -> None:
        """Kept for compatibility: connections belong to the loop's shared pool."""

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.kill()
        finally:
            await self.close()


async def _pages(http: AsyncHttp, path: str, key: str) -> List[Any]:
    out: List[Any] = []
    cursor: Optional[str] = None
    while True:
        q = {"limit": str(_core.PAGE_SIZE)}
        if cursor is not None:
            q["cursor"] = cursor
        page = (await http.call("GET", path, params=q, retry=True)).json()
        out.extend(page[key])
        cursor = page.get("next_cursor")
        if not cursor:
            return out


async def list_templates(*, url: str = "", token: str = "", config: Optional[Config] = None) -> List[Dict[str, Any]]:
    return await _pages(AsyncHttp(config or Config(url=url, token=token)), "/v1/templates", "templates")


async def usage(*, url: str = "", token: str = "") -> Dict[str, Any]:
    return (await AsyncHttp(Config(url=url, token=token)).call("GET", "/v1/usage", retry=True)).json()


async def _call(method: str, path: str, body: Any, url: str, token: str) -> Any:
    r = await AsyncHttp(Config(url=url, token=token)).call(method, path, body=body)
    return r.json() if r.content else None


async def create_template(image: str, *, url: str = "", token: str = "", **fields: Any) -> Dict[str, Any]:
    """`sandpool.create_template`, awaited (the same keyword fields)."""
    from .sandbox import template_body

    return await _call("POST", "/v1/templates", template_body(image, **fields), url, token)


async def delete_template(name: str, *, url: str = "", token: str = "") -> None:
    await _call("DELETE", f"/v1/templates/{name}", None, url, token)


async def prefetch(templates: Sequence[str] = (), *, images: Sequence[str] = (), nodes: Optional[Sequence[str]] = None,
                   url: str = "", token: str = "") -> List[Dict[str, Any]]:
    body: Dict[str, Any] = {"templates": list(templates), "images": list(images)}
    if nodes is not None:
        body["nodes"] = list(nodes)
    return (await _call("POST", "/v1/images:prefetch", body, url, token))["pulls"]


async def reserve(items: Mapping[str, int], ready_by: Union[float, str], *, hold_s: Optional[int] = None,
                  url: str = "", token: str = "") -> Dict[str, Any]:
    from .sandbox import reservation_body

    return await _call("POST", "/v1/reservations", reservation_body(items, ready_by, hold_s), url, token)


class AsyncFunction:
    """`Function` with `await` (`invoke`, `invoke_async`, `result`; `map` is an async iterator)."""

    def __init__(self, name: str, *, url: str = "", token: str = "", config: Optional[Config] = None) -> None:
        self.name = name
        self._http = AsyncHttp(config or Config(url=url, token=token))

    @classmethod
    async def deploy(cls, name: str, *, template: str, handler: Sequence[str], mode: str = "runtime",
                     env: Optional[Mapping[str, str]] = None, url: str = "", token: str = "",
                     config: Optional[Config] = None, **settings: Any) -> "AsyncFunction":
        f = cls(name, url=url, token=token, config=config)
        await f._http.call("PUT", _core.function_path(name),
                           body=_core.function_body(template, handler, mode, env, settings))
        return f

    @staticmethod
    async def list(*, url: str = "", token: str = "", config: Optional[Config] = None) -> List[Dict[str, Any]]:
        return await _pages(AsyncHttp(config or Config(url=url, token=token)), "/v1/functions", "functions")

    async def info(self) -> Dict[str, Any]:
        return (await self._http.call("GET", _core.function_path(self.name), retry=True)).json()

    async def delete(self) -> None:
        await self._http.call("DELETE", _core.function_path(self.name), retry=True)

    async def invoke(self, payload: Any = None, *, raw: bool = False, max_wait: Optional[float] = None,
                     timeout: Optional[float] = None) -> Any:
        params = {"max_wait_ms": str(int(max_wait * 1000))} if max_wait is not None else None
        r = await self._http.call("POST", _core.function_path(self.name, "/invoke"),
                                  content=_core.payload_bytes(payload), params=params,
                                  timeout=timeout or _core.INVOKE_TIMEOUT_S)
        return _core.invoke_result(r.content, r.headers.get("x-sandpool-function-error"), raw)

    async def invoke_async(self, payload: Any = None) -> str:
        r = await self._http.call("POST", _core.function_path(self.name, "/invoke"),
                                  content=_core.payload_bytes(payload), params={"async": "true"})
        return str(r.json()["invocation_id"])

    async def result(self, invocation_id: str, *, timeout: Optional[float] = None, raw: bool = False) -> Any:
        async def poll() -> Any:
            delay = _core.POLL_FIRST_S
            while True:
                inv = (await self._http.call("GET", f"/v1/invocations/{invocation_id}", retry=True)).json()
                if inv["state"] != "running":
                    return _core.invocation_result(inv, raw)
                await asyncio.sleep(delay)
                delay = min(_core.POLL_MAX_S, delay * 2)

        try:
            return await asyncio.wait_for(poll(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"invocation {invocation_id} is still running") from None

    async def map(self, payloads: Iterable[Any], *, raw: bool = False, return_exceptions: bool = False,
                  timeout: Optional[float] = None) -> AsyncIterator[Any]:
        async with self._http.stream("POST", _core.function_path(self.name, "/map"), content=_core.ndjson(payloads),
                                     headers={**self._http.cfg.headers, "content-type": "application/x-ndjson"},
                                     timeout=timeout or _core.MAP_TIMEOUT_S) as r:
            if r.status_code >= 400:
                await r.aread()
                _core.raise_for(r.status_code, r.content, r.headers.get("retry-after"))
            async for line in r.aiter_lines():
                if line.strip():
                    yield _core.map_item(json.loads(line), raw, return_exceptions)
