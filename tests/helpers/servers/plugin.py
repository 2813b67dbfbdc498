"""pytest fixtures for the real object-store test servers (register with
``pytest_plugins = ["tests.helpers.servers.plugin"]`` in tests/conftest.py).

Session-scoped, one server each, started on first use:
  ``seaweedfs``  S3 (s3fs), persistent across kill/restart   -> SeaweedFS
  ``azurite``    Azure Blob (adlfs)                          -> Azurite
  ``gcs_server`` GCS (gcsfs), in-memory                      -> GCSEmulator
Function-scoped helpers:
  ``fault_proxy``      factory: ``fault_proxy(target_port) -> FaultProxy`` (closed after the test)
  ``seaweedfs_proxy``  a FaultProxy in front of SeaweedFS' S3 port, with ``.storage_options``
  ``s3_url`` / ``az_url`` / ``gcs_url``  a fresh, empty path under each server's url_root
  ``seaweedfs_healthy`` like ``seaweedfs`` but makes sure it is running (restarts it if a previous
                        test killed or SIGSTOPped it); fault tests should leave it running anyway.

A missing binary/package skips the test with the reason; with TIERCHECK_REQUIRE_SERVERS=1 in the
environment (CI) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from . import gcs as _gcs
from .azurite import Azurite
from .faultproxy import FaultProxy, ProxiedServer, proxied
from .gcs import GCSEmulator
from .process import ObjectStoreServer
from .seaweedfs import SeaweedFS

S = TypeVar("S", bound=ObjectStoreServer)


def _missing(what: str) -> None:
    msg = f"{what}; install with: bash scripts/setup-servers.sh"
    if os.environ.get("TIERCHECK_REQUIRE_SERVERS", "") not in ("", "0"):
        pytest.fail(f"required test server unavailable: {msg}", pytrace=False)
    pytest.skip(msg)


def _need_module(name: str, pip_name: str) -> None:
    try:
        __import__(name)
    except ImportError:
        _missing(f"python package {pip_name} not installed")


def _serve(make: Callable[[str], S], name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S]:
    # Under pytest's basetemp (old runs pruned by pytest; logs stay there for post-mortems),
    # unless that path is long: SeaweedFS puts unix sockets in the work dir (108-byte limit).
    own_dir = len(str(tmp_path_factory.getbasetemp())) > 60
    workdir = tempfile.mkdtemp(prefix=f"tc-{name}-") if own_dir else str(tmp_path_factory.mktemp(name))
    server: S | None = None
    try:
        try:
            server = make(workdir)
        except FileNotFoundError as e:
            _missing(str(e))
        assert server is not None
        server.start()
        yield server
    finally:
        if server is not None:
            server.close()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
        else:  # keep *.log, drop the (possibly large) data
            for sub in ("data", "tmp"):
                shutil.rmtree(os.path.join(workdir, sub), ignore_errors=True)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """SeaweedFS `weed mini` on 127.0.0.1: url_root ``s3://tiercheck-test``."""
    _need_module("s3fs", "s3fs")
    yield from _serve(SeaweedFS, "weed", tmp_path_factory)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """Azurite blob service on 127.0.0.1: url_root ``az://tiercheck-test``."""
    _need_module("adlfs", "adlfs")
    yield from _serve(Azurite, "azurite", tmp_path_factory)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSEmulator]:
    """gcp-storage-emulator (in-memory) on 127.0.0.1: url_root ``gcs://tiercheck-test``."""
    _need_module("gcsfs", "gcsfs")
    problem = _gcs.gcsfs_import_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    yield from _serve(GCSEmulator, "gcs", tmp_path_factory)


def _ensure_running(server: ObjectStoreServer) -> None:
    server.cont_process()
    if not server.alive():
        server.restart()


@pytest.fixture
def seaweedfs_healthy(seaweedfs: SeaweedFS) -> SeaweedFS:
    _ensure_running(seaweedfs)
    return seaweedfs


@pytest.fixture
def s3_url(seaweedfs: SeaweedFS) -> str:
    return seaweedfs.unique_url()


@pytest.fixture
def az_url(azurite: Azurite) -> str:
    return azurite.unique_url()


@pytest.fixture
def gcs_url(gcs_server: GCSEmulator) -> str:
    return gcs_server.unique_url()


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    """Factory: ``fault_proxy(target_port, **knobs) -> FaultProxy``; all closed after the test."""
    made: list[FaultProxy] = []

    def make(target_port: int, **knobs: Any) -> FaultProxy:
        p = FaultProxy(target_port, **knobs)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()


@pytest.fixture
def seaweedfs_proxy(seaweedfs_healthy: SeaweedFS) -> Iterator[ProxiedServer]:
    """SeaweedFS behind a FaultProxy: ``.proxy`` (knobs), ``.storage_options``, ``.filesystem()``."""
    ps = proxied(seaweedfs_healthy)
    try:
        yield ps
    finally:
        ps.proxy.close()
