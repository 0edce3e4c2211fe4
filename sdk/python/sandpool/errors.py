"""Errors: one exception class per API error code, all under `SandpoolError`."""

from __future__ import annotations

from typing import Any, Dict, Optional


class SandpoolError(Exception):
    """An error answer of the API: its `code`, `message`, HTTP `status` and whole `body`."""

    code = "unknown"

    def __init__(self, message: str, *, status: int = 0, body: Optional[Dict[str, Any]] = None,
                 retry_after: Optional[float] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body or {}
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.code} ({self.status}): {self.message}"


class BadRequest(SandpoolError): code = "bad_request"
class InvalidPath(SandpoolError): code = "invalid_path"
class UnknownTemplate(SandpoolError): code = "unknown_template"
class ImageNotFound(SandpoolError): code = "image_not_found"
class IsDirectory(SandpoolError): code = "is_directory"
class Unauthorized(SandpoolError): code = "unauthorized"
class Forbidden(SandpoolError): code = "forbidden"
class NotFound(SandpoolError): code = "not_found"
class SessionGone(SandpoolError): code = "session_gone"
class Conflict(SandpoolError): code = "conflict"
class StaleFence(SandpoolError): code = "stale_fence"
class ShellGone(SandpoolError): code = "shell_gone"
class PayloadTooLarge(SandpoolError): code = "payload_too_large"
class TooManyRequests(SandpoolError): code = "too_many_requests"


class QuotaExceeded(SandpoolError):
    """A quota of the caller's path is reached: `dimension`, `path`, `limit`, `used`."""

    code = "quota_exceeded"

    @property
    def dimension(self) -> Optional[str]:
        return self.body.get("dimension")

    @property
    def path(self) -> Optional[str]:
        return self.body.get("path")

    @property
    def limit(self) -> Optional[float]:
        return self.body.get("limit")

    @property
    def used(self) -> Optional[float]:
        return self.body.get("used")


class Unavailable(SandpoolError): code = "unavailable"
class NodeFull(SandpoolError): code = "node_full"
class NodeUnavailable(SandpoolError): code = "node_unavailable"
class BadGateway(SandpoolError): code = "bad_gateway"
class ImagePullFailed(SandpoolError): code = "image_pull_failed"
class SandboxFailed(SandpoolError): code = "sandbox_failed"
class SandboxBusy(SandpoolError): code = "sandbox_busy"
class GatewayTimeout(SandpoolError): code = "gateway_timeout"
class FunctionTimeout(SandpoolError): code = "function_timeout"
class FunctionCrashed(SandpoolError): code = "function_crashed"
class Internal(SandpoolError): code = "internal"


class FunctionError(SandpoolError):
    """A function's own failure (its invocation answered 200 with `x-sandpool-function-error`):
    `type`, `message`, `traceback` from the runtime's report; `function_error` is `handled`
    (an exception the runtime reported) or `unhandled` (an exit status, a handler that died)."""

    code = "function_error"

    @property
    def type(self) -> Optional[str]:
        return self.body.get("type")

    @property
    def traceback(self) -> Any:
        return self.body.get("traceback")

    @property
    def function_error(self) -> Optional[str]:
        return self.body.get("function_error")


class InvocationLost(SandpoolError):
    """An asynchronous invocation whose gateway went away before it finished."""

    code = "invocation_lost"


_BY_CODE = {c.code: c for c in SandpoolError.__subclasses__()}


def from_answer(status: int, body: Any, retry_after: Optional[str]) -> SandpoolError:
    """The exception for an error answer (an unknown code is a plain `SandpoolError`)."""
    if not isinstance(body, dict):
        body = {"code": "unknown", "message": str(body)[:500]}
    cls = _BY_CODE.get(str(body.get("code")), SandpoolError)
    ra: Optional[float] = None
    if retry_after:
        try:
            ra = float(retry_after)
        except ValueError:
            ra = None
    return cls(str(body.get("message", "")), status=status, body=body, retry_after=ra)
