"""Azurite (Azure Blob emulator, npm ``azurite@3.35.0`` in ./node_modules) run with node.

Traps handled here (see shared/reference/test-infrastructure.md):
- ``--skipApiVersionCheck``: current azure-storage-blob sends an API version Azurite 3.35 rejects;
- ``--blobPort 0`` on the first start, the port is parsed from the log; restarts reuse it;
- adlfs has no retry knob and the default azure retry policy takes 80-170 s to give up on a
  dead server: ``filesystem(fast_fail=True)`` swaps in a service client with ``retry_total=0``;
- SIGKILL loses recently written metadata (persisted on graceful stop or periodic autosave):
  ``restart()`` is graceful by default; ``kill()`` + ``restart()`` is a lossy crash on purpose.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .process import ObjectStoreServer

REPO_ROOT = Path(__file__).resolve().parents[3]
ACCOUNT = "devstoreaccount1"
# Azurite's well-known, public development key (not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_LISTEN_RE = re.compile(r"successfully listens on http://127\.0\.0\.1:(\d+)")


def find_azurite_main() -> str | None:
    """Azurite's blob entry point: $TIERCHECK_AZURITE_MAIN or <repo>/node_modules/azurite/..."""
    env = os.environ.get("TIERCHECK_AZURITE_MAIN")
    p = Path(env) if env else REPO_ROOT / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
    return str(p) if p.is_file() else None


def find_node() -> str | None:
    return shutil.which("node")


def connection_string(port: int) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
    )


class Azurite(ObjectStoreServer):
    name = "azurite"
    protocol = "az"
    CONNECTION_TIMEOUT_S = 2
    READ_TIMEOUT_S = 10

    def __init__(self, workdir: str | os.PathLike[str], container: str = "tiercheck-test") -> None:
        super().__init__(workdir)
        node, main = find_node(), find_azurite_main()
        if node is None:
            raise FileNotFoundError("node not found on PATH")
        if main is None:
            raise FileNotFoundError("azurite not found in node_modules (npm package azurite@3.35.0)")
        self.node, self.main_js = node, main
        self.container = container
        self.data_dir = self.workdir / "data"
        self.data_dir.mkdir(exist_ok=True)
        self.port = 0  # 0 until the first start has parsed the real one

    @property
    def url_root(self) -> str:
        return f"az://{self.container}"

    @property
    def connection_string(self) -> str:
        return connection_string(self.port)

    def storage_options_via(self, port: int) -> dict[str, Any]:
        # connection/read timeouts go to every adlfs blob call; retries need filesystem(fast_fail=True)
        return {
            "connection_string": connection_string(port),
            "skip_instance_cache": True,
            "connection_timeout": self.CONNECTION_TIMEOUT_S,
            "read_timeout": self.READ_TIMEOUT_S,
        }

    def filesystem(self, port: int | None = None, fast_fail: bool = False, **overrides: Any) -> Any:
        """adlfs filesystem; ``fast_fail=True`` replaces its service client with one that has
        ``retry_total=0`` so a dead server fails at once (``ServiceRequestError``, or
        ``RuntimeError("Failed to upload block ...")`` from block uploads) instead of after minutes."""
        fs = super().filesystem(port, **overrides)
        if fast_fail:
            make_fast_fail(fs, connection_string(self.port if port is None else port))
        return fs

    def _command(self) -> Sequence[str]:
        return [
            self.node,
            self.main_js,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(self.port),
            "--location",
            str(self.data_dir),
            "--silent",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--loose",
        ]

    def _wait_ready(self, deadline: float) -> None:
        def listening() -> bool:
            m = _LISTEN_RE.search(self._current_log())
            if m is None:
                return False
            self.port = int(m.group(1))
            return True

        self._poll_until("'successfully listens on' in its log", deadline, listening)
        fs = self.filesystem(fast_fail=True)

        def container() -> bool:
            fs.invalidate_cache()
            if not fs.exists(self.container):
                fs.mkdir(self.container)
            fs.ls(self.container)
            return True

        self._poll_until(f"container {self.container}", deadline, container, interval=0.1)


def make_fast_fail(fs: Any, conn_str: str) -> None:
    """Give an adlfs filesystem a service client without retries (the trick from the reference doc)."""
    from adlfs.spec import _USER_AGENT  # type: ignore[import-untyped]
    from azure.storage.blob.aio import BlobServiceClient
    from fsspec.asyn import sync

    async def make() -> Any:
        return BlobServiceClient.from_connection_string(conn_str, retry_total=0, user_agent=_USER_AGENT)

    old = fs.service_client
    fs.service_client = sync(fs.loop, make)
    with contextlib.suppress(Exception):
        sync(fs.loop, old.close)
