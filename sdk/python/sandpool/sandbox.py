"""The synchronous client: `Sandbox`."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import httpx

from . import _core
from ._core import Cmd, CommandResult, Config, EntryInfo, SessionInfo, ShellInfo, ShellResult
from ._http import Http
from .errors import SandpoolError


class Commands:
    """`sb.commands.run(...)`: a command, collected (exec) or streamed to callbacks (WebSocket)."""

    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def run(self, cmd: Cmd, *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
            timeout: Optional[float] = None, stdin: Optional[str] = None,
            on_stdout: Optional[Callable[[str], Any]] = None,
            on_stderr: Optional[Callable[[str], Any]] = None, background: bool = False) -> Any:
        """Runs `cmd` (a shell string, or argv). `timeout` in seconds (default 300). With
        `background=True` it returns a `CommandHandle` at once (its stdin stays open until
        `close_stdin()`)."""
        if background:
            return CommandHandle(self._sb, cmd, env, cwd, timeout, stdin, on_stdout, on_stderr)
        if on_stdout is None and on_stderr is None:
            wait = (timeout or 300) + 30
            r = self._sb._http.call("POST", _core.session_path(self._sb.session_id, "/exec"),
                                    body=_core.exec_body(cmd, env, cwd, timeout, stdin), timeout=wait)
            return CommandResult.parse(r.json())
        return self._stream(cmd, env, cwd, timeout, stdin, on_stdout, on_stderr)

    def _stream(self, cmd: Cmd, env: Any, cwd: Any, timeout: Any, stdin: Any, on_stdout: Any,
                on_stderr: Any) -> CommandResult:
        from websockets.sync.client import connect

        cfg = self._sb._http.cfg
        url = cfg.ws_url + _core.session_path(self._sb.session_id, "/ws")
        cid = uuid.uuid4().hex
        collected = _core.Streamed(cid, on_stdout, on_stderr)
        with connect(url, additional_headers=cfg.headers, open_timeout=cfg.timeout) as ws:
            ws.send(json.dumps(_core.start_message(cid, cmd, env, cwd, timeout)))
            if stdin:
                ws.send(json.dumps({"type": "stdin", "id": cid, "data": stdin}))
            ws.send(json.dumps({"type": "stdin_eof", "id": cid}))
            while True:
                result = collected.feed(json.loads(ws.recv()))
                if result is not None:
                    return result


class CommandHandle:
    """A command running in the background over the session WebSocket."""

    def __init__(self, sb: "Sandbox", cmd: Cmd, env: Any, cwd: Any, timeout: Any, stdin: Optional[str],
                 on_stdout: Any, on_stderr: Any, pty: Optional[Mapping[str, int]] = None) -> None:
        import threading

        from websockets.sync.client import connect

        cfg = sb._http.cfg
        self.id = uuid.uuid4().hex
        self._ws = connect(cfg.ws_url + _core.session_path(sb.session_id, "/ws"), additional_headers=cfg.headers,
                           open_timeout=cfg.timeout)
        self._collected = _core.Streamed(self.id, on_stdout, on_stderr)
        self._result: Optional[CommandResult] = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self._ws.send(json.dumps(_core.start_message(self.id, cmd, env, cwd, timeout, pty)))
        if stdin:
            self.send_stdin(stdin)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while self._result is None:
                self._result = self._collected.feed(json.loads(self._ws.recv()))
        except BaseException as e:  # the socket closed, or the command failed to start
            self._error = e
        finally:
            self._done.set()

    def send_stdin(self, data: str) -> None:
        self._ws.send(json.dumps({"type": "stdin", "id": self.id, "data": data}))

    def close_stdin(self) -> None:
        self._ws.send(json.dumps({"type": "stdin_eof", "id": self.id}))

    def resize(self, rows: int, cols: int) -> None:
        """A terminal's new size (a `pty` command)."""
        self._ws.send(json.dumps({"type": "resize", "id": self.id, "rows": rows, "cols": cols}))

    def kill(self, signal: int = 9) -> None:
        """Sends `signal` (default SIGKILL) to the command's process group."""
        self._ws.send(json.dumps({"type": "signal", "id": self.id, "signal": signal}))

    def wait(self, timeout: Optional[float] = None) -> CommandResult:
        """Waits for the command to end (at most `timeout` seconds: TimeoutError)."""
        if not self._done.wait(timeout):
            raise TimeoutError("the command is still running")
        self._ws.close()
        if self._result is None:
            raise self._error or SandpoolError("the command's stream ended without its exit")
        return self._result


class Pty:
    """`sb.pty.create(rows, cols)`: an interactive terminal (a shell by default)."""

    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def create(self, rows: int = 24, cols: int = 80, *, cmd: Cmd = ("sh",), env: Optional[Mapping[str, str]] = None,
               cwd: Optional[str] = None, timeout: Optional[float] = 3600,
               on_data: Optional[Callable[[str], Any]] = None) -> CommandHandle:
        """Starts `cmd` on a terminal of `rows` x `cols`; type with `send_stdin`, `resize` it,
        and end it with `kill()` (the output arrives in `on_data`, and in `wait()`'s stdout)."""
        return CommandHandle(self._sb, list(cmd), env, cwd, timeout, None, on_data, None,
                             pty={"rows": rows, "cols": cols})


class Files:
    """`sb.files`: raw bytes in and out (a relative path is under the template's workdir)."""

    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def write(self, path: str, data: Union[bytes, str]) -> None:
        content = data.encode() if isinstance(data, str) else data
        self._sb._http.call("PUT", _core.file_path(self._sb.session_id, path), content=content, timeout=300)

    def read(self, path: str) -> bytes:
        return self._sb._http.call("GET", _core.file_path(self._sb.session_id, path), retry=True, timeout=300).content

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def list(self, path: str = ".") -> List[EntryInfo]:
        """A directory's entries, sorted by name (one level; links not followed)."""
        r = self._sb._http.call("GET", _core.dir_path(self._sb.session_id, path), retry=True)
        return _core.entries(r.json())

    def exists(self, path: str) -> bool:
        """Whether anything is at `path` (a symbolic link counts, dangling or not)."""
        r = self._sb._http.call("GET", _core.exists_path(self._sb.session_id, path), retry=True)
        return bool(r.json()["exists"])

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Removes a file, a link (not its target) or an empty directory; a directory with
        everything in it only with `recursive` (else `Conflict`). Nothing there: `NotFound`."""
        params = {"recursive": "true"} if recursive else None
        self._sb._http.call("DELETE", _core.file_path(self._sb.session_id, path), params=params)

    def rename(self, old_path: str, new_path: str) -> None:
        """Renames (moves) within the sandbox; `Conflict` if `new_path` exists."""
        self._sb._http.call("POST", _core.rename_path(self._sb.session_id), body={"from": old_path, "to": new_path})

    def make_dir(self, path: str) -> None:
        """Makes a directory and its parents (fine if it is there); `Conflict` if a file is."""
        self._sb._http.call("POST", _core.dir_path(self._sb.session_id, path), retry=True)

    def upload_dir(self, local_dir: str, remote_dir: str) -> int:
        """Copies a local directory into the sandbox, file by file; returns how many files."""
        n = 0
        for src, rel in _core.walk_files(local_dir):
            with open(src, "rb") as f:
                self.write(_core.join_remote(remote_dir, rel), f.read())
            n += 1
        return n

    def download_dir(self, remote_dir: str, local_dir: str) -> None:
        """Copies a sandbox directory's contents into `local_dir` (it travels as a tar;
        nothing lands outside `local_dir`)."""
        _core.extract_tar(self.read(remote_dir), local_dir)


class Shell:
    """A persistent shell: `cd`, variables and functions carry over between runs."""

    def __init__(self, sb: "Sandbox", info: Mapping[str, Any]) -> None:
        self._sb = sb
        self.name: str = info["name"]
        self.shell: str = info.get("shell", "sh")

    def _path(self, rest: str = "") -> str:
        return _core.session_path(self._sb.session_id, f"/shells/{self.name}{rest}")

    def run(self, cmd: str, *, timeout: Optional[float] = None, stdin: Optional[str] = None) -> ShellResult:
        r = self._sb._http.call("POST", self._path("/run"), body=_core.shell_run_body(cmd, timeout, stdin),
                                timeout=(timeout or 300) + 45)
        return ShellResult.parse(r.json())

    def interrupt(self) -> None:
        self._sb._http.call("POST", self._path("/interrupt"))

    def close(self) -> None:
        self._sb._http.call("DELETE", self._path(), retry=True)


class Shells:
    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def create(self, name: Optional[str] = None, *, shell: Optional[str] = None,
               env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> Shell:
        r = self._sb._http.call("POST", _core.session_path(self._sb.session_id, "/shells"),
                                body=_core.shell_create_body(name, shell, env, cwd))
        return Shell(self._sb, r.json())

    def list(self) -> List[ShellInfo]:
        r = self._sb._http.call("GET", _core.session_path(self._sb.session_id, "/shells"), retry=True)
        return [ShellInfo.parse(s) for s in r.json()["shells"]]


class Sandbox:
    """A session on a sandbox. `with Sandbox.create("busybox") as sb:` deletes it on exit."""

    def __init__(self, info: SessionInfo, http: Http) -> None:
        self.info = info
        self.session_id = info.session_id
        self._http = http
        self.commands = Commands(self)
        self.files = Files(self)
        self.shells = Shells(self)
        self.pty = Pty(self)

    @classmethod
    def create(cls, template: str, *, timeout: Optional[int] = None, idle_timeout: Optional[int] = None,
               labels: Optional[Mapping[str, str]] = None, session_key: Optional[str] = None,
               max_wait: Optional[float] = None, url: str = "", token: str = "",
               config: Optional[Config] = None) -> "Sandbox":
        """Opens a session on a warm sandbox of `template`. `timeout`/`idle_timeout` in seconds.
        Retried on 429/503 only with a `session_key` (which makes a retry safe)."""
        http = Http(config or Config(url=url, token=token))
        body = _core.create_body(template, timeout, idle_timeout, labels, session_key, max_wait)
        wait = (max_wait if max_wait is not None else 30) + http.cfg.timeout
        r = http.call("POST", "/v1/sessions", body=body, retry=session_key is not None, timeout=wait)
        return cls(SessionInfo.parse(r.json()), http)

    @classmethod
    def connect(cls, session_id: str, *, url: str = "", token: str = "",
                config: Optional[Config] = None) -> "Sandbox":
        http = Http(config or Config(url=url, token=token))
        r = http.call("GET", _core.session_path(session_id), retry=True)
        return cls(SessionInfo.parse(r.json()), http)

    @staticmethod
    def list(*, subtree: bool = False, label: Optional[str] = None, url: str = "", token: str = "",
             config: Optional[Config] = None) -> List[SessionInfo]:
        """The caller's live sessions, oldest first (`subtree`: its descendants' too;
        `label`: `"key=value"`), every page of them."""
        return list(Sandbox.iter(subtree=subtree, label=label, config=config or Config(url=url, token=token)))

    @staticmethod
    def iter(*, subtree: bool = False, label: Optional[str] = None, page_size: Optional[int] = None,
             url: str = "", token: str = "", config: Optional[Config] = None) -> Iterator[SessionInfo]:
        """`list`, a page at a time (`page_size` sessions a call): for fleets of thousands."""
        http = Http(config or Config(url=url, token=token))
        cursor: Optional[str] = None
        while True:
            params = _core.list_params(subtree, label, page_size, cursor)
            page = http.call("GET", "/v1/sessions", params=params, retry=True).json()
            yield from (SessionInfo.parse(s) for s in page["sessions"])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    @staticmethod
    def kill_all(*, label: str, subtree: bool = False, url: str = "", token: str = "",
                 config: Optional[Config] = None) -> int:
        """Ends every live session of the caller with `label` (`"key=value"`; `subtree`: its
        descendants' too) in one call; how many ended."""
        http = Http(config or Config(url=url, token=token))
        params = {"label": label, "subtree": "true" if subtree else "false"}
        return int(http.call("DELETE", "/v1/sessions", params=params, retry=True).json()["ended"])

    def refresh(self) -> SessionInfo:
        self.info = SessionInfo.parse(self._http.call("GET", _core.session_path(self.session_id), retry=True).json())
        return self.info

    def keepalive(self) -> SessionInfo:
        r = self._http.call("POST", _core.session_path(self.session_id, "/keepalive"), retry=True)
        self.info = SessionInfo.parse(r.json())
        return self.info

    def pause(self) -> None:
        self._http.call("POST", _core.session_path(self.session_id, "/pause"), retry=True)

    def set_egress(self, policy: str) -> SessionInfo:
        """Switches the session's named egress policy (one its template allows): new
        connections are checked against it at once, open ones it refuses are cut."""
        r = self._http.call("PUT", _core.session_path(self.session_id, "/egress"), body={"policy": policy}, retry=True)
        self.info = SessionInfo.parse(r.json())
        return self.info

    def resume(self) -> None:
        self._http.call("POST", _core.session_path(self.session_id, "/resume"), retry=True)

    def snapshot(self) -> str:
        """The session's filesystem as a new private template; its name."""
        return self._http.call("POST", _core.session_path(self.session_id, "/snapshot"), timeout=330).json()["template"]

    def fork(self, n: int) -> List["Sandbox"]:
        """`n` new sessions starting from this one's filesystem."""
        r = self._http.call("POST", _core.session_path(self.session_id, "/fork"), body={"count": n}, timeout=400)
        return [Sandbox(SessionInfo.parse(s), Http(self._http.cfg)) for s in r.json()["sessions"]]

    def get_url(self, port: int, path: str = "") -> str:
        """The URL of `port` in the sandbox through the gateway (a port the template lists in
        `ports`): any method, WebSockets too, with this client's bearer token
        (`Authorization: Bearer ...`). `path` is the path on the port's server."""
        return f"{self._http.cfg.url}{_core.session_path(self.session_id)}/ports/{int(port)}/{path.lstrip('/')}"

    def get_signed_url(self, port: int, *, ttl: int = 600) -> str:
        """A URL of `port` that works without a token for `ttl` seconds (at most a day), or
        until the session ends: for a browser, or a service that cannot send the header."""
        r = self._http.call("POST", _core.session_path(self.session_id, "/urls"), body={"port": port, "ttl_s": ttl},
                            retry=True)
        return f"{self._http.cfg.url}{r.json()['path']}"

    def kill(self) -> None:
        """Ends the session (its sandbox is destroyed); a session that already ended is fine."""
        try:
            self._http.call("DELETE", _core.session_path(self.session_id), retry=True)
        except SandpoolError as e:
            if e.code not in ("session_gone", "not_found"):
                raise

    def close(self) -> None:
        """Kept for compatibility: connections belong to the process's shared pool
        (`sandpool.close_pool()`); the session lives on until `kill()` or its timeout."""

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.kill()
        finally:
            self.close()


def usage(*, url: str = "", token: str = "") -> Dict[str, Any]:
    """The caller's limits and usage at every level of its path, its own first."""
    return Http(Config(url=url, token=token)).call("GET", "/v1/usage", retry=True).json()


def _call(method: str, path: str, body: Any, url: str, token: str) -> Any:
    r = Http(Config(url=url, token=token)).call(method, path, body=body)
    return r.json() if r.content else None


def template_body(image: str, *, name: Optional[str] = None, base: Optional[str] = None,
                  cpus: Optional[float] = None, memory_mb: Optional[int] = None, disk_mb: Optional[int] = None,
                  pids: Optional[int] = None, workdir: Optional[str] = None,
                  env: Optional[Mapping[str, str]] = None, network: Optional[str] = None) -> Dict[str, Any]:
    body: Dict[str, Any] = {"image": image}
    for k, v in (("name", name), ("base", base), ("cpus", cpus), ("memory_mb", memory_mb), ("disk_mb", disk_mb),
                 ("pids", pids), ("workdir", workdir), ("network", network)):
        if v is not None:
            body[k] = v
    if env:
        body["env"] = dict(env)
    return body


def create_template(image: str, *, url: str = "", token: str = "", **fields: Any) -> Dict[str, Any]:
    """A template made from a registry image, pinned to its digest now; yours alone
    (`<principal>/<name>`), or public (`public/<name>`) when made with an admin token.
    `fields`: `name`, `base`, `cpus`, `memory_mb`, `disk_mb`, `pids`, `workdir`, `env`, `network`."""
    return _call("POST", "/v1/templates", template_body(image, **fields), url, token)


def delete_template(name: str, *, url: str = "", token: str = "") -> None:
    """Deletes a snapshot or a template made from an image; sessions running it go on."""
    _call("DELETE", f"/v1/templates/{name}", None, url, token)


def prefetch(templates: Sequence[str] = (), *, images: Sequence[str] = (), nodes: Optional[Sequence[str]] = None,
             url: str = "", token: str = "") -> List[Dict[str, Any]]:
    """Pulls templates' images (admins: any images) onto nodes now; each pull's state."""
    body: Dict[str, Any] = {"templates": list(templates), "images": list(images)}
    if nodes is not None:
        body["nodes"] = list(nodes)
    return _call("POST", "/v1/images:prefetch", body, url, token)["pulls"]


def reservation_body(items: Mapping[str, int], ready_by: Union[float, str], hold_s: Optional[int]) -> Dict[str, Any]:
    if not isinstance(ready_by, str):
        ready_by = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ready_by))
    body: Dict[str, Any] = {"items": [{"template": t, "count": n} for t, n in items.items()], "ready_by": ready_by}
    if hold_s is not None:
        body["hold_s"] = hold_s
    return body


def reserve(items: Mapping[str, int], ready_by: Union[float, str], *, hold_s: Optional[int] = None,
            url: str = "", token: str = "") -> Dict[str, Any]:
    """Declares the next step: `{template: count}` idle by `ready_by` (a Unix time or RFC 3339);
    images of templates made from images start pulling at once."""
    return _call("POST", "/v1/reservations", reservation_body(items, ready_by, hold_s), url, token)


def list_templates(*, url: str = "", token: str = "", config: Optional[Config] = None) -> List[Dict[str, Any]]:
    """The templates the caller may start, every page of them."""
    return list(_pages(Http(config or Config(url=url, token=token)), "/v1/templates", "templates"))


def _pages(http: Http, path: str, key: str, params: Optional[Mapping[str, str]] = None) -> Iterator[Any]:
    """Every item of a paginated listing (`limit`, `cursor` -> `next_cursor`)."""
    cursor: Optional[str] = None
    while True:
        q = {**(params or {}), "limit": str(_core.PAGE_SIZE)}
        if cursor is not None:
            q["cursor"] = cursor
        page = http.call("GET", path, params=q, retry=True).json()
        yield from page[key]
        cursor = page.get("next_cursor")
        if not cursor:
            return


class Function:
    """A deployed function (`PUT /v1/functions/{name}`), invoked by name:

        reward = Function("reward")
        reward.invoke({"solution": "print(3)"})          # the result, JSON-decoded
        for r in reward.map(batch): ...                   # in input order, as they finish
        reward.result(reward.invoke_async(payload))       # started now, collected later

    A payload is JSON unless it is bytes; `raw=True` answers the result's bytes. A function's
    own failure raises `FunctionError`; the API's errors raise as everywhere else."""

    def __init__(self, name: str, *, url: str = "", token: str = "", config: Optional[Config] = None) -> None:
        self.name = name
        self._http = Http(config or Config(url=url, token=token))

    @classmethod
    def deploy(cls, name: str, *, template: str, handler: Sequence[str], mode: str = "runtime",
               env: Optional[Mapping[str, str]] = None, url: str = "", token: str = "",
               config: Optional[Config] = None, **settings: Any) -> "Function":
        """Creates or replaces the function (`settings`: `timeout_ms`, `max_concurrency`,
        `min_warm`, `max_env_invocations`, `env_idle_s`)."""
        f = cls(name, url=url, token=token, config=config)
        f._http.call("PUT", _core.function_path(name), body=_core.function_body(template, handler, mode, env, settings))
        return f

    @staticmethod
    def list(*, url: str = "", token: str = "", config: Optional[Config] = None) -> List[Dict[str, Any]]:
        """The caller's functions, by name, every page of them."""
        return list(_pages(Http(config or Config(url=url, token=token)), "/v1/functions", "functions"))

    def info(self) -> Dict[str, Any]:
        """The function's definition, with its environments now."""
        return self._http.call("GET", _core.function_path(self.name), retry=True).json()

    def delete(self) -> None:
        self._http.call("DELETE", _core.function_path(self.name), retry=True)

    def invoke(self, payload: Any = None, *, raw: bool = False, max_wait: Optional[float] = None,
               timeout: Optional[float] = None) -> Any:
        """Invokes the function and answers its result. `max_wait`: seconds to wait for a free
        environment at the function's `max_concurrency` (else 429 at once)."""
        params = {"max_wait_ms": str(int(max_wait * 1000))} if max_wait is not None else None
        r = self._http.call("POST", _core.function_path(self.name, "/invoke"), content=_core.payload_bytes(payload),
                            params=params, timeout=timeout or _core.INVOKE_TIMEOUT_S)
        return _core.invoke_result(r.content, r.headers.get("x-sandpool-function-error"), raw)

    def invoke_async(self, payload: Any = None) -> str:
        """Starts an invocation and answers its id at once (`result(id)` collects it)."""
        r = self._http.call("POST", _core.function_path(self.name, "/invoke"), content=_core.payload_bytes(payload),
                            params={"async": "true"})
        return str(r.json()["invocation_id"])

    def result(self, invocation_id: str, *, timeout: Optional[float] = None, raw: bool = False) -> Any:
        """An asynchronous invocation's result, waiting for it (at most `timeout` seconds:
        TimeoutError); raises as `invoke` would have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = _core.POLL_FIRST_S
        while True:
            inv = self._http.call("GET", f"/v1/invocations/{invocation_id}", retry=True).json()
            if inv["state"] != "running":
                return _core.invocation_result(inv, raw)
            if deadline is not None and time.monotonic() + poll > deadline:
                raise TimeoutError(f"invocation {invocation_id} is still running")
            time.sleep(poll)
            poll = min(_core.POLL_MAX_S, poll * 2)

    def map(self, payloads: Iterable[Any], *, raw: bool = False, return_exceptions: bool = False,
            timeout: Optional[float] = None) -> Iterator[Any]:
        """Invokes the function on every payload (one call; at most 10,000) and yields the
        results in input order as they finish. A failed payload raises its error, or is
        yielded as the exception with `return_exceptions=True`."""
        body = _core.ndjson(payloads)
        with self._http.stream("POST", _core.function_path(self.name, "/map"), content=body,
                               headers={**self._http.cfg.headers, "content-type": "application/x-ndjson"},
                               timeout=timeout or _core.MAP_TIMEOUT_S) as r:
            if r.status_code >= 400:
                r.read()
                _core.raise_for(r.status_code, r.content, r.headers.get("retry-after"))
            for line in r.iter_lines():
                if line.strip():
                    yield _core.map_item(json.loads(line), raw, return_exceptions)
