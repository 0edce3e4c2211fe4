"""What the sync and async clients share: configuration, retries, answers and models."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union
from urllib.parse import quote

import httpx

from .errors import SandpoolError, from_answer

Cmd = Union[str, Sequence[str]]


@dataclass
class Config:
    """Where the gateway is and who calls. Defaults: `SANDPOOL_URL`, `SANDPOOL_TOKEN`."""

    url: str = ""
    token: str = ""
    #: Seconds for calls that do not run a command.
    timeout: float = 60.0
    #: Retries of a call (see `retry_delay`): five back-offs from 0.1 s span ~3 s, about
    #: what a gateway takes to restart.
    max_retries: int = 5
    max_backoff: float = 30.0
    #: HTTP/2: None = where it helps (https and `h2` installed; see `_http._http2`).
    http2: Optional[bool] = None

    def __post_init__(self) -> None:
        self.url = (self.url or os.environ.get("SANDPOOL_URL") or "http://127.0.0.1:8080").rstrip("/")
        self.token = self.token or os.environ.get("SANDPOOL_TOKEN", "")
        if not self.token:
            raise ValueError("no token: pass token= or set SANDPOOL_TOKEN")

    @property
    def headers(self) -> Dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[len("http"):] if self.url.startswith("http") else self.url


#: The first back-off after a refused connection or `node_unavailable`; it doubles each time.
BACKOFF_BASE_S = 0.1


def backoff(attempt: int, cfg: Config) -> float:
    """Exponential back-off with jitter (so a fleet of clients does not retry in step)."""
    return min(cfg.max_backoff, BACKOFF_BASE_S * (2 ** attempt)) * (0.5 + 0.5 * random.random())


def retry_delay(err: BaseException, attempt: int, cfg: Config, *, idempotent: bool) -> Optional[float]:
    """Seconds to wait before retrying after `err`, or None when it is not worth retrying.

    - A connection that could not be opened (refused, or its connect timed out): the request
      never left, so any call is retried.
    - A connection that broke mid-call (reset, closed without an answer): idempotent calls.
    - `node_unavailable` (the session's node is restarting or unreachable): idempotent calls.
    - 429/503 with a `Retry-After`: idempotent calls, after the time it says (a quota of live
      sessions does not free itself by waiting: 429 without one is final).
    Creates count as idempotent only with a `session_key`."""
    if attempt >= cfg.max_retries:
        return None
    if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
        return backoff(attempt, cfg)
    if isinstance(err, httpx.TimeoutException):
        return None  # the call itself took too long: repeating it would take as long
    if isinstance(err, httpx.TransportError):
        return backoff(attempt, cfg) if idempotent else None
    if not isinstance(err, SandpoolError) or not idempotent:
        return None
    if err.code == "node_unavailable":
        return backoff(attempt, cfg) if err.retry_after is None else min(cfg.max_backoff, err.retry_after)
    if err.status in (429, 503) and err.retry_after is not None:
        return min(cfg.max_backoff, err.retry_after * (1.0 + 0.1 * random.random()))
    return None


def raise_for(status: int, body: bytes, retry_after: Optional[str]) -> None:
    if status < 400:
        return
    try:
        parsed: Any = json.loads(body) if body else {}
    except ValueError:
        parsed = body.decode("utf-8", "replace")
    raise from_answer(status, parsed, retry_after)


def session_path(session_id: str, rest: str = "") -> str:
    return f"/v1/sessions/{quote(session_id, safe='')}{rest}"


def file_path(session_id: str, path: str) -> str:
    # An absolute path keeps its leading '/' after the route's: `/files//tmp/x`.
    return session_path(session_id, "/files/" + quote(path, safe="/"))


def dir_path(session_id: str, path: str) -> str:
    # `.` would be dropped from the URL by the HTTP client: the workdir has a route of its own.
    if path in ("", ".", "./"):
        return session_path(session_id, "/dirs")
    return session_path(session_id, "/dirs/" + quote(path, safe="/"))


def exists_path(session_id: str, path: str) -> str:
    return session_path(session_id, "/exists/" + quote(path, safe="/"))


def rename_path(session_id: str) -> str:
    return session_path(session_id, "/files:rename")


def create_body(template: str, timeout: Optional[int], idle_timeout: Optional[int],
                labels: Optional[Mapping[str, str]], session_key: Optional[str],
                max_wait: Optional[float]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"template": template}
    for k, v in (("ttl_s", timeout), ("idle_timeout_s", idle_timeout), ("session_key", session_key),
                 ("max_wait_s", max_wait)):
        if v is not None:
            body[k] = v
    if labels:
        body["labels"] = dict(labels)
    return body


def exec_body(cmd: Cmd, env: Optional[Mapping[str, str]], cwd: Optional[str], timeout: Optional[float],
              stdin: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd)}
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if timeout is not None:
        body["timeout_ms"] = int(timeout * 1000)
    if stdin is not None:
        body["stdin"] = stdin
    return body


class _Model:
    """A dataclass read from an API answer (fields the answer adds later are ignored)."""

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> Any:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class SessionInfo(_Model):
    session_id: str
    sandbox_id: str
    node: str
    template: str
    expires_at: str = ""
    max_expires_at: str = ""
    created_at: str = ""
    start: Optional[str] = None
    wait_ms: Optional[float] = None
    session_key: Optional[str] = None
    labels: Dict[str, str] = field(default_factory=dict)
    paused: bool = False
    egress: Optional[str] = None
    # CPU the sandbox has used, and time it waited for having spent its CPU quota within a period
    # (`cpus`): absent when its node could not say in time.
    cpu_ms: Optional[float] = None
    cpu_throttled_ms: Optional[float] = None



@dataclass
class CommandResult(_Model):
    exit_code: int
    stdout: str
    stderr: str
    duration_ms: float = 0.0
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False



@dataclass
class ShellResult(_Model):
    exit_code: int
    output: str
    cwd: str
    duration_ms: float = 0.0
    timed_out: bool = False
    truncated: bool = False



@dataclass
class ShellInfo(_Model):
    name: str
    shell: str
    cwd: str
    busy: bool = False


@dataclass
class EntryInfo(_Model):
    """One entry of `sb.files.list(dir)`: `type` is `file`, `dir`, `symlink` or `other`."""
    name: str
    type: str
    size: int
    mode: int
    modified_at: str
    path: str = ""

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"


def entries(listing: Mapping[str, Any]) -> List[EntryInfo]:
    """A `DirListing` answer as entries, each with its absolute `path`."""
    base = listing["path"].rstrip("/")
    return [EntryInfo.parse({**e, "path": f"{base}/{e['name']}"}) for e in listing["entries"]]


def shell_run_body(cmd: str, timeout: Optional[float], stdin: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"cmd": cmd}
    if timeout is not None:
        body["timeout_ms"] = int(timeout * 1000)
    if stdin is not None:
        body["stdin"] = stdin
    return body


def shell_create_body(name: Optional[str], shell: Optional[str], env: Optional[Mapping[str, str]],
                      cwd: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    for k, v in (("name", name), ("shell", shell), ("cwd", cwd)):
        if v is not None:
            body[k] = v
    if env:
        body["env"] = dict(env)
    return body


class Streamed:
    """Collects a streamed command's messages (`wire::ws`) and calls the callbacks."""

    def __init__(self, cid: str, on_stdout: Any, on_stderr: Any) -> None:
        self.cid = cid
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.out: List[str] = []
        self.err: List[str] = []

    def feed(self, m: Mapping[str, Any]) -> Optional[CommandResult]:
        """Takes one message; the result once the command has exited."""
        if m.get("id") not in (self.cid, None):
            return None
        kind = m.get("type")
        if kind == "stdout":
            self.out.append(m["data"])
            if self.on_stdout:
                self.on_stdout(m["data"])
        elif kind == "stderr":
            self.err.append(m["data"])
            if self.on_stderr:
                self.on_stderr(m["data"])
        elif kind == "exit":
            return CommandResult(exit_code=m["exit_code"], stdout="".join(self.out), stderr="".join(self.err),
                                 duration_ms=m.get("duration_ms", 0.0), timed_out=m.get("timed_out", False))
        elif kind == "error":
            raise from_answer(0, m, None)
        return None


def walk_files(local_dir: str) -> List[Any]:
    """(path, path relative to `local_dir` with '/') of every regular file under it."""
    out = []
    for root, _dirs, files in os.walk(local_dir):
        for name in sorted(files):
            src = os.path.join(root, name)
            if os.path.isfile(src) and not os.path.islink(src):
                out.append((src, os.path.relpath(src, local_dir).replace(os.sep, "/")))
    return out


def join_remote(remote_dir: str, rel: str) -> str:
    return remote_dir.rstrip("/") + "/" + rel if remote_dir else rel


def extract_tar(data: bytes, local_dir: str) -> None:
    """Extracts a directory download; members that would land outside `local_dir` (absolute,
    `..`, links out) are refused."""
    import io
    import tarfile

    os.makedirs(local_dir, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        try:
            tar.extractall(local_dir, filter="data")
        except TypeError:  # a Python without extraction filters: check by hand
            root = os.path.realpath(local_dir)
            for m in tar.getmembers():
                target = os.path.realpath(os.path.join(root, m.name))
                if not (target == root or target.startswith(root + os.sep)) or m.issym() or m.islnk():
                    raise ValueError(f"unsafe member in the download: {m.name}")
            tar.extractall(local_dir)


def start_message(cid: str, cmd: Cmd, env: Optional[Mapping[str, str]], cwd: Optional[str],
                  timeout: Optional[float], pty: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
    m = exec_body(cmd, env, cwd, timeout, None)
    m.update({"type": "start", "id": cid})
    if pty:
        m["pty"] = dict(pty)
    return m


#: Items asked for per page when a listing walks every page: the gateway's most, since each
#: page of sessions reads every selected record (see docs/notes/gateway.md, `page.rs`).
PAGE_SIZE = 1000


def list_params(subtree: bool, label: Optional[str], limit: Optional[int],
                cursor: Optional[str]) -> Dict[str, str]:
    params = {"subtree": "true" if subtree else "false"}
    if label is not None:
        params["label"] = label
    params["limit"] = str(limit if limit is not None else PAGE_SIZE)
    if cursor is not None:
        params["cursor"] = cursor
    return params


#: Client-side bound of an invocation: a function's `timeout_ms` is at most 15 min, plus the
#: wait for an environment.
INVOKE_TIMEOUT_S = 1000.0
#: A map's whole answer (10,000 payloads through `max_concurrency` environments).
MAP_TIMEOUT_S = 3600.0
#: Polling an asynchronous invocation: from 50 ms, doubling up to 1 s.
POLL_FIRST_S = 0.05
POLL_MAX_S = 1.0


def function_body(template: str, handler: Sequence[str], mode: str, env: Optional[Mapping[str, str]],
                  settings: Mapping[str, Any]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"template": template, "mode": mode, "handler": list(handler), **settings}
    if env:
        body["env"] = dict(env)
    return body


def ndjson(payloads: Iterable[Any]) -> bytes:
    """A map's body: one JSON payload per line (bytes payloads must be JSON text already)."""
    lines = []
    for p in payloads:
        lines.append(bytes(p) if isinstance(p, (bytes, bytearray, memoryview)) else json.dumps(p).encode())
    return b"\n".join(lines) + b"\n"


def map_item(line: Mapping[str, Any], raw: bool, return_exceptions: bool) -> Any:
    try:
        return map_line(line, raw)
    except SandpoolError as e:
        if return_exceptions:
            return e
        raise


def function_path(name: str, rest: str = "") -> str:
    return f"/v1/functions/{quote(name, safe='')}{rest}"


def payload_bytes(payload: Any) -> bytes:
    """What an invocation sends: bytes as they are, anything else as JSON."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    return json.dumps(payload).encode()


def invoke_result(content: bytes, function_error: Optional[str], raw: bool) -> Any:
    """An invocation's 200 answer: the result (JSON-decoded unless `raw`), or `FunctionError`
    when the function failed (`function_error`: `handled`/`unhandled`)."""
    from .errors import FunctionError

    if function_error:
        try:
            report = json.loads(content) if content else {}
        except ValueError:
            report = {"message": content.decode("utf-8", "replace")}
        if not isinstance(report, dict):
            report = {"message": str(report)}
        raise FunctionError(str(report.get("message", "")), status=200,
                            body={**report, "function_error": function_error})
    if raw:
        return content
    return json.loads(content) if content else None


def invocation_result(inv: Mapping[str, Any], raw: bool) -> Any:
    """A finished asynchronous invocation (`GET /v1/invocations/{id}`) as `invoke` would
    answer it: the result, `FunctionError`, or the API error the call would have raised."""
    from .errors import InvocationLost

    if inv["state"] == "lost":
        raise InvocationLost(f"invocation {inv['invocation_id']} was lost with its gateway", status=200,
                             body=dict(inv))
    status = int(inv.get("status", 200))
    result = inv.get("result")
    if status != 200:
        raise from_answer(status, result, None)
    if inv.get("function_error"):
        content = json.dumps(result).encode()
        return invoke_result(content, inv["function_error"], raw)
    if raw:
        return result.encode() if isinstance(result, str) else json.dumps(result).encode()
    return result


def map_line(line: Mapping[str, Any], raw: bool) -> Any:
    """One line of a map's answer as `invoke` would answer it (an error is raised)."""
    return invocation_result({"state": "done", "invocation_id": "", **line}, raw)
