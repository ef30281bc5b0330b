"""Claude Code's CLI (npm ``@anthropic-ai/claude-code``), installed once per machine under the shared cache.

``$DEEPINFER_GATEWAY_CACHE/claude-code-<version>`` holds an ``npm install --prefix`` of the pinned version: npm
brings the native binary for this platform as an optional dependency from the registry (about 370 MB), built under
a file lock in a ``.partial-<pid>`` directory that is renamed into place once ``claude --version`` answered.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..cached_build import build_once, cache_dir, run_logged

VERSION = "2.1.328"
PACKAGE = f"@anthropic-ai/claude-code@{VERSION}"

OFFLINE_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}
"""What Claude Code needs to talk to nobody but ``ANTHROPIC_BASE_URL``: no usage telemetry, no error reports, no
update check, no other non-essential request (without them it looks up api.anthropic.com at start). With
``ANTHROPIC_API_KEY`` set, print mode (``-p``) uses it as is: no login."""


def claude_binary() -> Path:
    """The ``claude`` executable, installing it first if this machine has none (about a minute)."""
    npm = shutil.which("npm")
    assert npm is not None, "Claude Code's test needs Node.js and npm (npm install of " + PACKAGE + ")"
    target = cache_dir() / f"claude-code-{VERSION}"

    def build(partial: Path, log: Path) -> str:
        partial.mkdir(parents=True)
        install = [npm, "install", "--prefix", str(partial), "--no-audit", "--no-fund", "--loglevel=error", PACKAGE]
        run_logged(install, log, what="Claude Code")
        run_logged([str(partial / "node_modules" / ".bin" / "claude"), "--version"], log, what="Claude Code")
        return PACKAGE

    build_once(target, build)
    return target / "node_modules" / ".bin" / "claude"


if __name__ == "__main__":
    print(claude_binary())
