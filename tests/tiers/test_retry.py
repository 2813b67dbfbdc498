"""Which object-store errors are retried: decided by exception type, errno, HTTP status and
service error code, never by the message's text (a path such as ``step-000000000503`` or
a server's prose must not make a permanent error look like a 503)."""

from __future__ import annotations

import contextlib
import errno
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from aiohttp import ClientConnectorError, ClientResponseError, ServerDisconnectedError
from azure.core.exceptions import HttpResponseError, ServiceRequestError
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError
from gcsfs.retry import HttpError

import tiercheck
from tests.helpers.faulty_fs import Faults, FaultyMemoryFileSystem
from tiercheck.format import naming
from tiercheck.tiers.retry import RetryPolicy, is_transient

STEP_503 = f"/bucket/run/{naming.step_dir_name(503)}/{naming.shard_name(0, 1)}"


def s3_error(code: str, status: int, message: str = "") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


def azure_error(status: int, code: str, message: str) -> HttpResponseError:
    err = HttpResponseError(message=message)
    err.status_code = status  # what azure-core sets from the response
    err.error_code = code
    return err


def caused_by(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


PERMANENT = {
    "EINVAL naming step 503": OSError(errno.EINVAL, "Invalid argument: 503 Service Unavailable", STEP_503),
    "ValueError quoting 503": ValueError(f"bad object name {STEP_503}: HTTP 503, 502, 504, timed out, SlowDown"),
    "s3 AccessDenied 403": s3_error("AccessDenied", 403, f"Access Denied for {STEP_503} (was 503 earlier)"),
    "s3 InvalidArgument 400": s3_error("InvalidArgument", 400, "Connection refused 503"),
    "s3fs EIO over a 400": caused_by(OSError(errno.EIO, "503 reset by peer"), s3_error("BadThing", 400)),
    "aiohttp 403": ClientResponseError(None, (), status=403, message=f"Forbidden {STEP_503}"),  # type: ignore[arg-type]
    "gcs 404 code": HttpError({"code": 404, "message": f"No such object: {STEP_503} 503"}),
    "azure 403": azure_error(403, "AuthorizationFailure", f"{STEP_503}: 503"),
    "PermissionError": PermissionError(errno.EACCES, "503 Service Unavailable", STEP_503),
    "FileNotFoundError": FileNotFoundError(errno.ENOENT, "No such key", STEP_503),
    "NoCredentialsError": NoCredentialsError(),
    "RuntimeError 500": RuntimeError("500 Internal Server Error"),
}

TRANSIENT = {
    "s3 SlowDown 503": s3_error("SlowDown", 503, "Please reduce your request rate."),
    "s3 InternalError 500": s3_error("InternalError", 500),
    "s3 throttled 400 code": s3_error("Throttling", 400),
    "s3 502 any code": s3_error("BadGateway", 502),
    "s3 RequestTimeout 400": s3_error("RequestTimeout", 400),
    "s3fs EBUSY (SlowDown)": OSError(errno.EBUSY, "Please reduce your request rate."),
    "s3fs EIO over a 503": caused_by(OSError(errno.EIO, "no digits here"), s3_error("Unknown", 503)),
    "aiohttp 503": ClientResponseError(None, (), status=503, message="Service Unavailable"),  # type: ignore[arg-type]
    "aiohttp 429": ClientResponseError(None, (), status=429, message="Too Many Requests"),  # type: ignore[arg-type]
    "gcs 503 code": HttpError({"code": 503, "message": "Backend Error"}),
    "azure 500": azure_error(500, "InternalError", "Server error"),
    "azure ServerBusy": azure_error(503, "ServerBusy", "busy"),
    "azure ServiceRequestError": ServiceRequestError("cannot connect"),
    "ConnectionResetError": ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "TimeoutError": TimeoutError("took too long"),
    "OSError ETIMEDOUT": OSError(errno.ETIMEDOUT, "timed out"),
    "OSError ECONNREFUSED": OSError(errno.ECONNREFUSED, "refused"),
    "botocore EndpointConnectionError": EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
    "botocore ReadTimeoutError": ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
    "aiohttp ServerDisconnectedError": ServerDisconnectedError(),
    "aiohttp ClientConnectorError": ClientConnectorError(None, OSError(errno.ECONNREFUSED, "x")),  # type: ignore[arg-type]
    "wrapped cause": caused_by(RuntimeError("upload failed"), ConnectionResetError()),
}


@pytest.mark.parametrize("exc", PERMANENT.values(), ids=PERMANENT.keys())
def test_permanent_errors_are_not_retried_whatever_their_text(exc: BaseException) -> None:
    assert is_transient(exc) is False


@pytest.mark.parametrize("exc", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_transient_errors_are_retried(exc: BaseException) -> None:
    assert is_transient(exc) is True


def test_policy_retries_a_503_and_stops_at_a_permanent_error() -> None:
    policy = RetryPolicy(budget_s=60, initial_s=0.001, max_s=0.002)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise s3_error("SlowDown", 503)
        return "ok"

    assert policy.run(flaky) == "ok"
    assert len(calls) == 3

    calls.clear()

    def denied() -> str:
        calls.append(1)
        raise s3_error("AccessDenied", 403, f"{STEP_503} 503")

    with pytest.raises(ClientError):
        policy.run(denied)
    assert len(calls) == 1


# ----------------------------------------------------------------------------- in the pipeline


@pytest.fixture
def bucket() -> Iterator[str]:
    name = f"bucket-{uuid.uuid4().hex[:12]}/run"
    yield name
    FaultyMemoryFileSystem(skip_instance_cache=True).clear_under(f"/{name}")


def test_a_permanent_error_on_step_503_fails_at_once(tmp_path: Path, bucket: str) -> None:
    """The error's text names the step's path, ``.../step-000000000503/...``: the upload must
    fail at once, not be retried for the whole (default, 120 s) budget."""
    faults = Faults()

    def invalid(path: str) -> BaseException:
        return OSError(errno.EINVAL, f"InvalidArgument: 503 bytes refused for {path}", path)

    faults.fail(invalid, ops={"write"})
    ckpt = tiercheck.Checkpointer(
        local=tmp_path, remote=f"faultymem://{bucket}", storage_options={"faults": faults}, keep_local=None
    )
    try:
        t0 = time.monotonic()
        handle = ckpt.save(503, {"x": torch.ones(1000)})
        with pytest.raises(tiercheck.TierError) as info:
            handle.wait("remote", timeout=60)
        assert time.monotonic() - t0 < 10
        assert info.value.step == 503 and info.value.tier == "remote"
        assert naming.step_dir_name(503) in str(info.value.__cause__)
        assert faults.injected() == 1  # one attempt, no retry
        faults.heal()
        ckpt.save(504, {"x": torch.ones(1000)}).wait(timeout=60)
        assert ckpt.steps("remote") == [504]
    finally:
        faults.heal()
        with contextlib.suppress(tiercheck.TiercheckError):
            ckpt.close()


def test_a_503_status_on_step_503_is_retried(tmp_path: Path, bucket: str) -> None:
    faults = Faults()
    faults.fail(lambda path: s3_error("SlowDown", 503, f"slow down on {path}"), times=2, ops={"write"})
    with tiercheck.Checkpointer(
        local=tmp_path, remote=f"faultymem://{bucket}", storage_options={"faults": faults}, keep_local=None
    ) as ckpt:
        ckpt.save(503, {"x": torch.ones(1000)}).wait(timeout=60)
        assert ckpt.steps("remote") == [503]
    assert faults.injected() == 2
