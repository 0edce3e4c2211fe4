"""The process's connections to gateways: one shared pool per gateway URL (sync), and per
gateway URL and event loop (async), with the retry policy of `_core.retry_delay`.

A sandbox no longer builds its own client: building an `httpx` client (its TLS context
included) and opening a connection cost ~15 ms, more than a warm create itself. Every
`Sandbox`, `Function` and module-level call of the process shares the pool instead; the
token travels per request, so principals with different tokens share it too.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import Any, Dict, MutableMapping, Optional, Tuple

import httpx

from . import _core
from ._core import Config
from .errors import SandpoolError

#: Connections kept per gateway: enough for a trainer's thread pool or a few hundred
#: concurrent coroutines without queueing on the pool.
POOL_CONNECTIONS = 256

_lock = threading.Lock()
_sync: Dict[Tuple[str, bool], httpx.Client] = {}
# Async clients are bound to the loop that made their connections: one set per loop, dropped
# with the loop.
_async: "MutableMapping[asyncio.AbstractEventLoop, Dict[Tuple[str, bool], httpx.AsyncClient]]" = (
    weakref.WeakKeyDictionary())


def _forget_after_fork() -> None:
    # A forked child must not share its parent's sockets (both would read the same answers).
    global _lock
    _lock = threading.Lock()
    _sync.clear()
    _async.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _http2(cfg: Config) -> bool:
    """HTTP/2 where it helps: to a gateway behind TLS (one connection multiplexes every call
    of the process, instead of one per call in flight) when `h2` is installed (`pip install
    sandpool[http2]`). Over plain HTTP httpx would not negotiate it anyway (HTTP/2 comes by
    TLS's ALPN), so the pool stays HTTP/1.1 keep-alive connections. Not measured here: the
    gateways of the tests and benchmarks speak plain HTTP."""
    if cfg.http2 is not None:
        return cfg.http2
    if not cfg.url.startswith("https://"):
        return False
    try:
        import h2  # noqa: F401
    except ImportError:
        return False
    return True


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS)


def sync_client(cfg: Config) -> httpx.Client:
    key = (cfg.url, _http2(cfg))
    with _lock:
        client = _sync.get(key)
        if client is None or client.is_closed:
            client = httpx.Client(base_url=cfg.url, timeout=cfg.timeout, limits=_limits(), http2=key[1])
            _sync[key] = client
        return client


def async_client(cfg: Config) -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    key = (cfg.url, _http2(cfg))
    with _lock:
        clients = _async.setdefault(loop, {})
        client = clients.get(key)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout, limits=_limits(), http2=key[1])
            clients[key] = client
        return client


def close_pool() -> None:
    """Closes the process's synchronous connections (they reopen on the next call). Not
    needed before exit; useful in a long-lived process that is done with sandpool."""
    with _lock:
        clients = list(_sync.values())
        _sync.clear()
    for c in clients:
        c.close()


def _send_kwargs(cfg: Config, body: Any, content: Optional[bytes], params: Any,
                 timeout: Optional[float]) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {"timeout": timeout or cfg.timeout, "headers": cfg.headers}
    if body is not None:
        kwargs["json"] = body
    if content is not None:
        kwargs["content"] = content
    if params is not None:
        kwargs["params"] = params
    return kwargs


class Http:
    """A caller (`Config`) over the shared synchronous pool."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.client = sync_client(cfg)

    def call(self, method: str, path: str, *, body: Any = None, content: Optional[bytes] = None,
             params: Any = None, retry: bool = False, timeout: Optional[float] = None) -> httpx.Response:
        """One API call; `retry`: the call is idempotent (see `_core.retry_delay`)."""
        attempt = 0
        kwargs = _send_kwargs(self.cfg, body, content, params, timeout)
        while True:
            try:
                r = self.client.request(method, path, **kwargs)
                _core.raise_for(r.status_code, r.content, r.headers.get("retry-after"))
                return r
            except (SandpoolError, httpx.TransportError) as e:
                delay = _core.retry_delay(e, attempt, self.cfg, idempotent=retry)
                if delay is None:
                    raise
                attempt += 1
                time.sleep(delay)

    def stream(self, method: str, path: str, **kw: Any) -> Any:
        """A streamed answer (`with http.stream(...) as r:`); not retried."""
        kw.setdefault("headers", self.cfg.headers)
        return self.client.stream(method, path, **kw)

    def close(self) -> None:
        """Nothing to close: the pool is the process's (`sandpool.close_pool()`)."""


class AsyncHttp:
    """A caller (`Config`) over the running loop's shared pool."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @property
    def client(self) -> httpx.AsyncClient:
        return async_client(self.cfg)

    async def call(self, method: str, path: str, *, body: Any = None, content: Optional[bytes] = None,
                   params: Any = None, retry: bool = False, timeout: Optional[float] = None) -> httpx.Response:
        attempt = 0
        kwargs = _send_kwargs(self.cfg, body, content, params, timeout)
        client = self.client
        while True:
            try:
                r = await client.request(method, path, **kwargs)
                _core.raise_for(r.status_code, r.content, r.headers.get("retry-after"))
                return r
            except (SandpoolError, httpx.TransportError) as e:
                delay = _core.retry_delay(e, attempt, self.cfg, idempotent=retry)
                if delay is None:
                    raise
                attempt += 1
                await asyncio.sleep(delay)

    def stream(self, method: str, path: str, **kw: Any) -> Any:
        kw.setdefault("headers", self.cfg.headers)
        return self.client.stream(method, path, **kw)

    async def close(self) -> None:
        """Nothing to close: the pool is the loop's."""
