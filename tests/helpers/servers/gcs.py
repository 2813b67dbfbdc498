"""gcp-storage-emulator (pure Python, PyPI) with gcsfs, run ``--in-memory``.

Traps handled here (see shared/reference/test-infrastructure.md):
- gcsfs >= 2026.10 reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT at *import* time and, unless it is
  "false", tries gRPC storage-control against the emulator and blocks 60 s per bucket call.
  Importing this module sets it; the fixture fails loudly if gcsfs was imported before that.
- ``--port 0`` works but the port is not printed, so the port is chosen here.
- In-memory: a restart loses every object. ``restart()`` re-creates the bucket (empty).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from .ports import free_port
from .process import ObjectStoreServer, ServerStartError

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before anything imports gcsfs


def find_emulator() -> str | None:
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("gcp-storage-emulator", path=path)


def gcsfs_import_problem() -> str | None:
    """None if gcsfs is importable in the plain (non-gRPC) mode; else what is wrong."""
    try:
        import gcsfs  # type: ignore[import-untyped]
    except ImportError as e:
        return f"gcsfs not importable ({e})"
    if gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
        return (
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set; its calls would "
            "block 60 s each against the emulator. Register tests.helpers.servers.plugin (or import tests.helpers.servers) "
            "before anything imports gcsfs, or export the variable."
        )
    return None


class GCSEmulator(ObjectStoreServer):
    name = "gcs-emulator"
    protocol = "gcs"
    PROJECT = "test"
    REQUESTS_TIMEOUT_S = 10

    def __init__(self, workdir: str | os.PathLike[str], bucket: str = "tiercheck-test") -> None:
        super().__init__(workdir)
        exe = find_emulator()
        if exe is None:
            raise FileNotFoundError("gcp-storage-emulator not found (pip package gcp-storage-emulator)")
        self.exe = exe
        self.bucket = bucket
        self.port = 0
        self.recreate_bucket_on_restart = True

    @property
    def url_root(self) -> str:
        return f"gcs://{self.bucket}"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options_via(self, port: int) -> dict[str, Any]:
        return {
            "endpoint_url": f"http://127.0.0.1:{port}",
            "token": "anon",
            "project": self.PROJECT,
            "skip_instance_cache": True,
            "requests_timeout": self.REQUESTS_TIMEOUT_S,
        }

    def _command(self) -> Sequence[str]:
        return [self.exe, "start", "-H", "127.0.0.1", "--port", str(self.port), "--in-memory", "-q"]

    def _wait_ready(self, deadline: float) -> None:
        import json
        import urllib.request

        def answers() -> bool:
            url = f"{self.endpoint_url}/storage/v1/b?project={self.PROJECT}"
            with urllib.request.urlopen(url, timeout=1) as r:
                json.load(r)
                return True

        self._poll_until("the JSON API to answer", deadline, answers)
        if not self.recreate_bucket_on_restart and self.start_seconds:
            return
        fs = self.filesystem()

        def bucket() -> bool:
            fs.invalidate_cache()
            if not fs.exists(self.bucket):
                fs.mkdir(self.bucket)
            fs.ls(self.bucket)
            return True

        self._poll_until(f"bucket {self.bucket}", deadline, bucket, interval=0.1)

    def start(self, timeout: float = 30.0) -> None:
        problem = gcsfs_import_problem()
        if problem:
            raise RuntimeError(problem)
        if self.port:
            return self._start(timeout)
        last: Exception | None = None
        for _ in range(3):
            self.port = free_port()
            try:
                self._start(timeout)
                return
            except ServerStartError as e:
                last = e
                if "Address already in use" not in str(e):
                    raise
                time.sleep(0.2)
        assert last is not None
        raise last
