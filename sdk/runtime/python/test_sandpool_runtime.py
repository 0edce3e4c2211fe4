"""Tests of sandpool_runtime: each starts the worker as a subprocess and speaks the protocol.

Run with: python3 -m pytest -q sdk/runtime/python
"""

import json
import os
import re
import select
import subprocess
import sys
import threading
import time

import pytest

RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 15.0  # seconds, for any one read, write or exit

HANDLERS = r'''
import asyncio
import os
import sys

counter = 0
CONST = 42


class Boom(Exception):
    pass


def echo(event):
    return event


def count(event):
    global counter
    counter += 1
    return counter


def is_none(event):
    return {"is_none": event is None}


def fail(event):
    if event and event.get("fail") == "custom":
        raise Boom("boom: " + event["why"])
    if event and event.get("fail") == "builtin":
        raise ValueError("bad value")
    return "ok"


def raw(event):
    return b"\x00\xffraw bytes\n"


def noisy(event):
    print("printed by handler")
    sys.stdout.write("no newline yet")
    os.system("echo hi from a child")
    os.write(1, b"straight to fd 1\n")
    return "quiet"


def reads_stdin(event):
    os.system("cat")  # must see /dev/null, not the host's frames
    return sys.stdin.read()


async def coro(event):
    await asyncio.sleep(0.01)
    return {"async": event}


def returns_coro(event):
    return coro(event)


def with_ctx(event, context):
    return {"event": event, "context": context}


def unserialisable(event):
    return {1, 2}


def nan(event):
    return float("nan")


def exits(event):
    sys.exit(3)
'''

BROKEN = "raise RuntimeError('broken at import')\n"

HEADER = re.compile(rb"([A-Z]+) (0|[1-9][0-9]*) (0|[1-9][0-9]*)\n\Z")


class Worker:
    """One runtime subprocess with bounded frame I/O."""

    def __init__(self, spec, tmp_path, env=None, pythonpath=None):
        full_env = dict(os.environ)
        full_env.pop("SANDPOOL_FUNCTION", None)
        full_env.update(env or {})
        if pythonpath is None:
            pythonpath = [RUNTIME_DIR, str(tmp_path)]
        full_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool_runtime", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=str(tmp_path),
            env=full_env,
        )
        self.out = self.proc.stdout.fileno()
        self.buf = bytearray()
        self.err = bytearray()
        self._err_thread = threading.Thread(target=self._drain_stderr, daemon=True)
        self._err_thread.start()

    def _drain_stderr(self):
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self.err += chunk

    def _fill(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.out], [], [], left)[0]:
            raise TimeoutError("no output from the worker in time; stderr: %r" % bytes(self.err))
        chunk = os.read(self.out, 1 << 20)
        if not chunk:
            raise EOFError("worker closed stdout; stderr: %r" % bytes(self.err))
        self.buf += chunk

    def read_exact(self, n, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while len(self.buf) < n:
            self._fill(deadline)
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def read_frame(self, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            assert len(self.buf) < 64, "header too long: %r" % bytes(self.buf)
            self._fill(deadline)
        end = self.buf.index(b"\n") + 1
        header = bytes(self.buf[:end])
        del self.buf[:end]
        m = HEADER.match(header)
        assert m, "malformed header %r" % header
        body = self.read_exact(int(m.group(3)), max(0.0, deadline - time.monotonic()))
        return m.group(1).decode(), int(m.group(2)), body

    def read_to_eof(self, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._fill(deadline)
        except EOFError:
            pass
        data = bytes(self.buf)
        self.buf.clear()
        return data

    def write(self, data, timeout=TIMEOUT):
        errors = []

        def run():
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        assert not t.is_alive(), "write to the worker timed out"
        if errors:
            raise errors[0]

    def send(self, verb, ident, body=b""):
        self.write(b"%s %d %d\n" % (verb.encode(), ident, len(body)) + body)

    def ready(self):
        assert self.read_exact(len(b"READY 0 0\n")) == b"READY 0 0\n"

    def invoke(self, ident, payload):
        if not isinstance(payload, bytes):
            payload = json.dumps(payload).encode()
        self.send("INVOKE", ident, payload)
        verb, got, body = self.read_frame()
        assert got == ident
        return verb, body

    def call(self, ident, payload):
        verb, body = self.invoke(ident, payload)
        assert verb == "RESULT", body
        return json.loads(body)

    def close_stdin(self):
        self.proc.stdin.close()

    def wait(self, timeout=TIMEOUT):
        return self.proc.wait(timeout)

    def stderr_text(self, wanted=None, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while wanted is not None and wanted.encode() not in self.err:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return bytes(self.err).decode("utf-8", "replace")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(TIMEOUT)
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self._err_thread.join(TIMEOUT)
            self.proc.stderr.close()


@pytest.fixture
def start(tmp_path):
    (tmp_path / "handlers.py").write_text(HANDLERS)
    (tmp_path / "broken.py").write_text(BROKEN)
    workers = []

    def make(spec, **kwargs):
        w = Worker(spec, tmp_path, **kwargs)
        workers.append(w)
        return w

    try:
        yield make
    finally:
        for w in workers:
            w.kill()


def test_ready_first_then_json_round_trip_and_clean_exit(start):
    w = start("handlers:echo")
    w.ready()
    assert w.call(1, {"a": [1, 2.5, "x"], "b": None}) == {"a": [1, 2.5, "x"], "b": None}
    verb, body = w.invoke(2, {"k": "v"})
    assert (verb, body) == ("RESULT", b'{"k":"v"}')  # compact JSON
    w.close_stdin()
    assert w.wait() == 0
    assert w.read_to_eof() == b""


def test_module_state_survives_invocations(start):
    w = start("handlers:count")
    w.ready()
    assert [w.call(i, None) for i in range(1, 6)] == [1, 2, 3, 4, 5]


def test_empty_payload_is_none(start):
    w = start("handlers:is_none")
    w.ready()
    assert w.call(1, b"") == {"is_none": True}
    assert w.call(2, b"null") == {"is_none": True}
    assert w.call(3, b"0") == {"is_none": False}


@pytest.mark.parametrize("payload", [b"{not json", b'"\xff"', b"[1,"])
def test_invalid_payload(start, payload):
    w = start("handlers:echo")
    w.ready()
    verb, body = w.invoke(1, payload)
    assert verb == "ERROR"
    err = json.loads(body)
    assert err["type"] == "InvalidPayload"
    assert "JSON" in err["message"]
    assert err["traceback"] == []
    assert w.call(2, [1]) == [1]  # still serving


def test_exception_becomes_error_and_worker_keeps_serving(start):
    w = start("handlers:fail")
    w.ready()
    verb, body = w.invoke(1, {"fail": "custom", "why": "because"})
    assert verb == "ERROR"
    err = json.loads(body)
    assert set(err) == {"type", "message", "traceback"}
    assert err["type"] == "handlers.Boom"
    assert err["message"] == "boom: because"
    tb = err["traceback"]
    assert isinstance(tb, list) and all(isinstance(line, str) and "\n" not in line for line in tb)
    assert tb[0].startswith("Traceback")
    assert any('raise Boom("boom: " + event["why"])' in line for line in tb)
    assert tb[-1] == "handlers.Boom: boom: because"
    assert not any("sandpool_runtime.py" in line for line in tb)

    assert w.call(2, {}) == "ok"
    verb, body = w.invoke(3, {"fail": "builtin"})
    assert verb == "ERROR"
    err = json.loads(body)
    assert (err["type"], err["message"]) == ("ValueError", "bad value")
    assert w.call(4, None) == "ok"


def test_bytes_result_is_raw(start):
    w = start("handlers:raw")
    w.ready()
    assert w.invoke(1, None) == ("RESULT", b"\x00\xffraw bytes\n")
    assert w.invoke(2, None) == ("RESULT", b"\x00\xffraw bytes\n")


def test_handler_output_goes_to_stderr(start):
    w = start("handlers:noisy")
    w.ready()
    assert w.call(1, None) == "quiet"
    assert w.call(2, None) == "quiet"
    log = w.stderr_text(wanted="straight to fd 1")
    assert "printed by handler" in log
    assert "no newline yet" in log
    assert "hi from a child" in log
    assert "straight to fd 1" in log
    w.close_stdin()
    assert w.wait() == 0
    assert w.read_to_eof() == b""  # nothing but the frames already read


def test_handler_and_children_do_not_read_protocol_stdin(start):
    w = start("handlers:reads_stdin")
    w.ready()
    assert w.call(1, None) == ""
    assert w.call(2, None) == ""


def test_async_handler(start):
    for spec in ("handlers:coro", "handlers:returns_coro"):
        w = start(spec)
        w.ready()
        assert w.call(1, "x") == {"async": "x"}
        assert w.call(2, "y") == {"async": "y"}


def test_context_with_function_name(start):
    w = start("handlers:with_ctx", env={"SANDPOOL_FUNCTION": "scorer"})
    w.ready()
    assert w.call(7, 1) == {"event": 1, "context": {"invocation_id": "7", "function": "scorer"}}
    assert w.call(8, None)["context"] == {"invocation_id": "8", "function": "scorer"}


def test_context_without_function_name(start):
    w = start("handlers:with_ctx")
    w.ready()
    assert w.call(1, None)["context"] == {"invocation_id": "1", "function": ""}


@pytest.mark.parametrize(
    "spec, error_type",
    [
        ("no_such_module_xyz:fn", "ModuleNotFoundError"),
        ("handlers:missing", "AttributeError"),
        ("handlers:CONST", "TypeError"),
        ("handlers", "ValueError"),
        ("broken:fn", "RuntimeError"),
    ],
)
def test_bad_handler_spec(start, spec, error_type):
    w = start(spec)
    verb, ident, body = w.read_frame()
    assert (verb, ident) == ("ERROR", 0)
    err = json.loads(body)
    assert err["type"] == error_type
    assert err["message"]
    assert isinstance(err["traceback"], list) and err["traceback"]
    assert w.read_to_eof() == b""
    assert w.wait() == 1


def test_stdin_eof_exits_zero(start):
    w = start("handlers:echo")
    w.ready()
    w.close_stdin()
    assert w.wait() == 0
    assert w.read_to_eof() == b""


def test_large_payload_round_trip(start):
    w = start("handlers:echo")
    w.ready()
    payload = json.dumps("x" * (5 * 1024 * 1024)).encode()
    verb, body = w.invoke(1, payload)
    assert verb == "RESULT"
    assert body == payload
    assert w.call(2, [1, 2]) == [1, 2]


def test_unserialisable_result(start):
    for spec in ("handlers:unserialisable", "handlers:nan"):
        w = start(spec)
        w.ready()
        verb, body = w.invoke(1, None)
        assert verb == "ERROR"
        assert json.loads(body)["type"] == "ResultError"


def test_handler_on_cwd_without_pythonpath(start):
    w = start("handlers:echo", pythonpath=[RUNTIME_DIR])
    w.ready()
    assert w.call(1, "cwd") == "cwd"


def test_system_exit_ends_worker(start):
    w = start("handlers:exits")
    w.ready()
    w.send("INVOKE", 1, b"")
    assert w.read_to_eof() == b""
    assert w.wait() == 3


def test_protocol_error_from_host_ends_worker(start):
    w = start("handlers:echo")
    w.ready()
    w.write(b"HELLO 1 0\n")
    assert w.wait() == 2
    assert w.read_to_eof() == b""
    assert "protocol error" in w.stderr_text(wanted="protocol error")
