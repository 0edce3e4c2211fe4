"""sandpool: pooled, stateful sandboxes for agentic RL, from Python.

    from sandpool import Sandbox
    with Sandbox.create("busybox") as sb:           # SANDPOOL_URL, SANDPOOL_TOKEN
        print(sb.commands.run("echo hi").stdout)

`AsyncSandbox` has the same surface with `await` / `async with`; `Function(name)` invokes a
deployed function (`AsyncFunction` with `await`); the async module-level calls are in
`sandpool.aio`. Every call of the process shares one connection pool per gateway.
"""

from ._core import CommandResult, Config, EntryInfo, SessionInfo, ShellInfo, ShellResult
from ._http import close_pool
from .aio import AsyncFunction, AsyncSandbox, AsyncShell
from .errors import *  # noqa: F401,F403  (one exception class per API error code)
from .errors import FunctionError, SandpoolError
from .sandbox import (Function, Sandbox, Shell, create_template, delete_template, list_templates, prefetch,
                      reserve, usage)

__all__ = ["Sandbox", "AsyncSandbox", "Function", "AsyncFunction", "FunctionError", "close_pool", "list_templates", "Shell", "AsyncShell", "CommandResult", "ShellResult", "SessionInfo",
           "ShellInfo", "EntryInfo",
           "Config", "SandpoolError", "usage", "create_template", "delete_template", "prefetch", "reserve"]
__version__ = "0.1.0"
