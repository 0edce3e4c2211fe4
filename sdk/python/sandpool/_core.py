"""What the sync and async clients share: configuration, retries, answers and models."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union
from urllib.parse import quote

from .errors import SandpoolError, from_answer

Cmd = Union[str, Sequence[str]]


@dataclass
class Config:
    """Where the gateway is and who calls. Defaults: `SANDPOOL_URL`, `SANDPOOL_TOKEN`."""

    url: str = ""
    token: str = ""
    #: Seconds for calls that do not run a command.
    timeout: float = 60.0
    #: Retries of a call refused with 429/503 and a `Retry-After` (idempotent calls only,
    #: and creates that carry a `session_key`).
    max_retries: int = 3
    max_backoff: float = 30.0

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


def retry_delay(err: SandpoolError, attempt: int, cfg: Config) -> Optional[float]:
    """Seconds to wait before retrying after `err`, or None when it is not worth retrying
    (only 429/503 that say when: a quota of live sessions does not free itself by waiting)."""
    if err.status not in (429, 503) or err.retry_after is None or attempt >= cfg.max_retries:
        return None
    return min(cfg.max_backoff, err.retry_after * (1.0 + 0.1 * random.random()))


def raise_for(status: int, body: bytes, retry_after: Optional[str]) -> None:
    if status < 400:
        return
    try:
        import json

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
