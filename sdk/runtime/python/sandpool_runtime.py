"""sandpool function runtime for Python (protocol version 1, see ../PROTOCOL.md).

Usage, as a function's handler in runtime mode:

    python3 -m sandpool_runtime module:function

The worker imports ``module`` (the working directory comes first on sys.path), answers
``READY``, then serves ``INVOKE`` frames one at a time until stdin closes. The payload is
JSON (empty: ``None``); the handler is called as ``function(event)`` or, when it takes two
positional arguments, ``function(event, context)`` with context ``{"invocation_id": str,
"function": str}``; it may be ``async def``. It returns ``bytes`` (sent as they are) or
anything JSON-serialisable. Exceptions become ERROR frames and the worker keeps serving.
Whatever the handler (or a child process) writes to stdout goes to stderr, the log.

Stdlib only; Python 3.9+.
"""

import asyncio
import importlib
import inspect
import json
import os
import re
import sys
import traceback

PROTOCOL_VERSION = 1
MAX_BODY = 64 * 1024 * 1024
_HEADER = re.compile(rb"([A-Z]+) ([0-9]{1,20}) ([0-9]{1,20})\n\Z")
_HEADER_LIMIT = 64


class ProtocolError(Exception):
    """The host sent something that is not a frame this worker understands."""


# ---------------------------------------------------------------------------------------
# Frames


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def send_frame(fd, verb, ident, body=b""):
    header = b"%s %d %d\n" % (verb, ident, len(body))
    if len(body) <= 65536:
        _write_all(fd, header + body)
    else:
        _write_all(fd, header)
        _write_all(fd, body)


def read_frame(reader):
    """Next (verb, id, body) from the host, or None at a clean end of input."""
    line = reader.readline(_HEADER_LIMIT)
    if not line:
        return None
    m = _HEADER.match(line)
    if m is None:
        raise ProtocolError("malformed frame header %r" % line[:_HEADER_LIMIT])
    verb, ident, length = m.group(1), int(m.group(2)), int(m.group(3))
    if length > MAX_BODY:
        raise ProtocolError("frame body of %d bytes exceeds %d" % (length, MAX_BODY))
    body = reader.read(length) if length else b""
    if len(body) != length:
        raise ProtocolError("input ended %d bytes into a %d-byte body" % (len(body), length))
    return verb, ident, body


def error_body(type_name, message, tb_lines=()):
    doc = {"type": type_name, "message": message, "traceback": list(tb_lines)}
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def _type_name(exc):
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return "%s.%s" % (cls.__module__, cls.__qualname__)


def _traceback_lines(exc):
    tb = exc.__traceback__
    # Leave out the runtime's own frames at the top of the stack.
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return text.splitlines()


def exception_body(exc):
    return error_body(_type_name(exc), str(exc), _traceback_lines(exc))


# ---------------------------------------------------------------------------------------
# Handler


def load_handler(spec):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError("handler must be 'module:function', got %r" % spec)
    cwd = os.getcwd()
    if cwd in sys.path:
        sys.path.remove(cwd)
    sys.path.insert(0, cwd)
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError("%s is not callable (it is a %s)" % (spec, type(obj).__name__))
    return obj


def takes_context(fn):
    """Whether fn can be called with two positional arguments (event, context)."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature available (some builtins)
        return False
    return True


class Worker:
    def __init__(self, fn):
        self.fn = fn
        self.with_context = takes_context(fn)
        self.loop = None

    def _await(self, awaitable):
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        return self.loop.run_until_complete(awaitable)

    def invoke(self, ident, payload):
        """Run one invocation: (b"RESULT" | b"ERROR", body)."""
        if payload:
            try:
                event = json.loads(payload.decode("utf-8"))
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
                return b"ERROR", error_body("InvalidPayload", "payload is not valid JSON: %s" % e)
        else:
            event = None
        try:
            if self.with_context:
                context = {
                    "invocation_id": str(ident),
                    "function": os.environ.get("SANDPOOL_FUNCTION", ""),
                }
                result = self.fn(event, context)
            else:
                result = self.fn(event)
            if inspect.isawaitable(result):
                result = self._await(result)
        except Exception as e:
            return b"ERROR", exception_body(e)
        if isinstance(result, (bytes, bytearray, memoryview)):
            body = bytes(result)
        else:
            try:
                body = json.dumps(result, separators=(",", ":"), allow_nan=False).encode("utf-8")
            except (TypeError, ValueError, RecursionError) as e:
                return b"ERROR", error_body("ResultError", "result is not JSON-serialisable: %s" % e)
        if len(body) > MAX_BODY:
            return b"ERROR", error_body(
                "ResultError", "result of %d bytes exceeds %d" % (len(body), MAX_BODY)
            )
        return b"RESULT", body


# ---------------------------------------------------------------------------------------
# Process


def _flush_logs():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _take_stdio():
    """Keep fds 0 and 1 for frames only; give the handler /dev/null and stderr instead."""
    proto_in = os.dup(0)  # dup'd fds are not inherited by child processes
    proto_out = os.dup(1)
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    return os.fdopen(proto_in, "rb"), proto_out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    reader, out = _take_stdio()
    try:
        if len(argv) != 1:
            raise ValueError("usage: python3 -m sandpool_runtime module:function")
        worker = Worker(load_handler(argv[0]))
    except BaseException as e:  # SystemExit at import too: report it, then fail
        traceback.print_exc()
        _flush_logs()
        send_frame(out, b"ERROR", 0, exception_body(e))
        return 1
    send_frame(out, b"READY", 0)
    while True:
        try:
            frame = read_frame(reader)
            if frame is not None and frame[0] != b"INVOKE":
                raise ProtocolError("unexpected frame %s %d" % (frame[0].decode(), frame[1]))
        except ProtocolError as e:
            print("sandpool_runtime: protocol error: %s" % e, file=sys.stderr, flush=True)
            return 2
        if frame is None:
            return 0
        _, ident, payload = frame
        verb, body = worker.invoke(ident, payload)
        _flush_logs()
        send_frame(out, verb, ident, body)


if __name__ == "__main__":
    sys.exit(main())
