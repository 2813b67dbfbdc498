"""The tier conformance suite (`tiercheck.testing.conformance`) run over every tier here.

Each case is a fixture returning a `TierCase`. Adding a tier (e.g. a real S3 server from
``tests/helpers/servers``) takes two steps:

1. write a fixture that returns a `TierCase`, e.g.::

       @pytest.fixture
       def seaweedfs_case(s3_url: str, seaweedfs: Any) -> TierCase:
           return remote_case("s3", s3_url, seaweedfs.storage_options)

   (it may depend on server fixtures, and skip when their binary is absent);
2. append its name to `TIER_CASES`. Every check then runs against it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from tiercheck.testing.conformance import CHECKS, NotApplicable, TierCase, check_tier
from tiercheck.testing.dicttier import DictStore, DictTier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import RemoteTier


def local_case(root: Path) -> TierCase:
    def put_raw(rel: str, data: bytes) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    return TierCase(make_tier=lambda: LocalTier(root), put_raw=put_raw, role="local", location=root, kind="local")


def remote_case(kind: str, url: str, storage_options: dict[str, Any] | None = None) -> TierCase:
    """A case for any fsspec URL; raw writes go through a fresh fsspec filesystem."""
    opts = dict(storage_options or {})

    def put_raw(rel: str, data: bytes) -> None:
        fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **opts)
        if url.startswith("file://"):
            fs.makedirs(fs._parent(f"{root.rstrip('/')}/{rel}"), exist_ok=True)
        fs.pipe_file(f"{root.rstrip('/')}/{rel}", data)

    return TierCase(
        make_tier=lambda: RemoteTier(url, opts),
        put_raw=put_raw,
        role="remote",
        location=url,
        storage_options=opts,
        compression=True,
        kind=kind,
    )


# ------------------------------------------------------------------------- the cases


@pytest.fixture
def local_dir_case(tmp_path: Path) -> TierCase:
    return local_case(tmp_path / "tier")


@pytest.fixture
def file_url_case(tmp_path: Path) -> TierCase:
    return remote_case("file", f"file://{tmp_path / 'bucket' / 'run'}")


@pytest.fixture
def memory_url_case() -> Iterator[TierCase]:
    name = f"conformance-{uuid.uuid4().hex}"
    yield remote_case("memory", f"memory://{name}/run")
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


# Gaps a tier shows only on real servers, as strict xfails per (case, check), so the checks
# themselves stay the same for every tier. Empty now; keep the mechanism for the next one.
SERVER_XFAILS: dict[str, dict[str, str]] = {}


def server_case(name: str, server: Any, request: pytest.FixtureRequest) -> TierCase:
    """A case on a real object-store server from tests/helpers/servers (a fresh prefix per test)."""
    check = request.node.callspec.params.get("check")
    reason = SERVER_XFAILS.get(name, {}).get(getattr(check, "__name__", ""))
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    opts = {k: v for k, v in server.storage_options.items() if k != "skip_instance_cache"}
    return remote_case(server.protocol, server.unique_url("conf"), opts)


@pytest.fixture
def seaweedfs_case(seaweedfs_healthy: Any, request: pytest.FixtureRequest) -> TierCase:
    return server_case("seaweedfs_case", seaweedfs_healthy, request)


@pytest.fixture
def azurite_case(azurite: Any, request: pytest.FixtureRequest) -> TierCase:
    return server_case("azurite_case", azurite, request)


@pytest.fixture
def gcs_case(gcs_server: Any, request: pytest.FixtureRequest) -> TierCase:
    return server_case("gcs_case", gcs_server, request)


@pytest.fixture
def dicttier_case() -> TierCase:
    """The dict-backed tier of `tiercheck.testing.dicttier`, passed to Checkpointer as an object."""
    store = DictStore()
    return TierCase(make_tier=lambda: DictTier(store), put_raw=store.put, role="remote", kind="dicttier")


TIER_CASES = [
    "local_dir_case",
    "dicttier_case",
    "file_url_case",
    "memory_url_case",
    "seaweedfs_case",
    "azurite_case",
    "gcs_case",
]


@pytest.fixture(params=TIER_CASES)
def case(request: pytest.FixtureRequest) -> TierCase:
    got = request.getfixturevalue(request.param)
    assert isinstance(got, TierCase)
    return got


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_conformance(check: Callable[[TierCase, Path], None], case: TierCase, tmp_path: Path) -> None:
    try:
        check(case, tmp_path)
    except NotApplicable as why:
        pytest.skip(str(why))


def test_check_tier_runs_every_check_without_pytest(tmp_path: Path) -> None:
    def new_case() -> TierCase:
        store = DictStore()
        return TierCase(make_tier=lambda: DictTier(store), put_raw=store.put)

    skipped = check_tier(new_case, tmp_path)
    assert set(skipped) == {"check_compressed_round_trip"}
