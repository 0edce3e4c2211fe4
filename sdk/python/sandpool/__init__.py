"""sandpool: pooled, stateful sandboxes for agentic RL, from Python.

    from sandpool import Sandbox
    with Sandbox.create("busybox") as sb:           # SANDPOOL_URL, SANDPOOL_TOKEN
        print(sb.commands.run("echo hi").stdout)

`AsyncSandbox` has the same surface with `await` / `async with`.
"""

from ._core import CommandResult, Config, EntryInfo, SessionInfo, ShellInfo, ShellResult
from .aio import AsyncSandbox, AsyncShell
from .errors import *  # noqa: F401,F403  (one exception class per API error code)
from .errors import SandpoolError
from .sandbox import Sandbox, Shell, create_template, delete_template, prefetch, reserve, usage

__all__ = ["Sandbox", "AsyncSandbox", "Shell", "AsyncShell", "CommandResult", "ShellResult", "SessionInfo",
           "ShellInfo", "EntryInfo",
           "Config", "SandpoolError", "usage", "create_template", "delete_template", "prefetch", "reserve"]
__version__ = "0.1.0"
