"""`tiercheck ls` and `tiercheck verify` (python -m tiercheck)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.helpers.faulty_fs import Faults, FaultyMemoryFileSystem
from tiercheck.__main__ import main
from tiercheck.format import naming

REPO = Path(__file__).resolve().parents[2]


def test_ls_and_verify_single_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((1000,), float(step)), "n": step})
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("\t")[:3] for ln in lines] == [["1", "1 rank", "1 entries"], ["2", "1 rank", "1 entries"]]
    assert main(["verify", str(tmp_path)]) == 0
    shard = tmp_path / "step-000000000002" / naming.shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step 1: ok" in out and "step 2: FAILED" in out and "checksum mismatch" in out
    assert main(["verify", f"file://{tmp_path}", "--step", "1"]) == 0  # URLs too


# ----------------------------------------------------------------------------- nothing checked


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m tiercheck ARGS` in a fresh interpreter, as a user runs it."""
    full_env = dict(env if env is not None else os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "tiercheck", *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tiercheck: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_a_missing_path_is_an_error_not_an_empty_success(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    missing = tmp_path / "ckpt" / "typo"
    assert main([cmd, str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"tiercheck: no such directory: {missing}: check the path (a tier root, as given to local=)\n"
    assert not missing.exists()  # a reader never creates the tier


@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_a_directory_without_steps_checks_nothing_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    (tmp_path / "some-file").write_text("not a checkpoint")
    assert main([cmd, str(tmp_path)]) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"tiercheck: no committed step: {tmp_path}: ")
    assert main([cmd, str(tmp_path / "some-file")]) == 2  # a file, not a tier root
    assert capsys.readouterr().err.startswith(f"tiercheck: not a directory: {tmp_path / 'some-file'}: ")
    (tmp_path / naming.step_dir_name(4)).mkdir()  # an interrupted save: no commit marker
    (tmp_path / naming.step_dir_name(4) / naming.shard_name(0, 1)).write_bytes(b"half")
    assert main([cmd, f"file://{tmp_path}"]) == 2
    assert "1 step directories there have no commit marker" in capsys.readouterr().err


def test_verify_of_a_step_that_is_not_committed_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ck:
        ck.save(3, {"w": torch.ones(10)})
    assert main(["verify", str(tmp_path), "--step", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"tiercheck: step 4 is not committed: {tmp_path}: committed steps there: 3 (run `tiercheck ls {tmp_path}`)\n"
    )
    assert main(["verify", str(tmp_path), "--step", "3"]) == 0


def test_ls_reports_an_unreadable_step_in_its_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ck:
        ck.save(1, {"w": torch.ones(10)})
    (tmp_path / naming.step_dir_name(1) / naming.COMMIT_NAME).write_bytes(b"{not json")
    assert main(["ls", str(tmp_path)]) == 1
    assert "UNREADABLE" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"tiercheck {importlib.metadata.version('tiercheck')}\n"
    proc = run_cli("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"tiercheck {tiercheck.__version__}\n", "")


def closed_port() -> int:
    """A local port nothing listens on: connections to it are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def no_aws_env() -> dict[str, str]:
    """The environment of a user without AWS credentials (and no instance metadata)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


def test_an_s3_location_without_credentials_is_one_line(tmp_path: Path) -> None:
    options = json.dumps({"endpoint_url": f"http://127.0.0.1:{closed_port()}"})
    t0 = time.monotonic()
    proc = run_cli("ls", "s3://no-such-bucket/run", "--storage-options", options, env=no_aws_env())
    line = assert_one_line_error(proc, "s3://no-such-bucket/run", "NoCredentialsError", "credentials")
    assert "Traceback" not in line
    assert time.monotonic() - t0 < 60  # fails fast: not the library's 120 s retry budget


def test_an_unreachable_s3_endpoint_is_one_line_and_fails_fast() -> None:
    port = closed_port()
    env = no_aws_env()
    env.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    proc = run_cli("verify", "s3://no-such-bucket/run", env=env)  # the default --timeout, 10 s
    elapsed = time.monotonic() - t0
    assert_one_line_error(proc, "cannot list s3://no-such-bucket/run", "EndpointConnectionError", f":{port}")
    assert elapsed < 60


def test_bad_storage_options_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["ls", "s3://b/run", "--storage-options", "[1, 2]"])
    assert info.value.code == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_a_store_failing_mid_verify_is_one_line_not_damage(capsys: pytest.CaptureFixture[str]) -> None:
    """Listed fine, then every read is refused: nothing was verified, so exit status 2
    (not 1, "damaged"), one line, no traceback."""
    name = f"cli-{uuid.uuid4().hex[:8]}"
    url = f"faultymem://{name}/run"
    faults = Faults.named(name)
    try:
        with tiercheck.Checkpointer(remote=url, storage_options={"faults": name}) as ck:
            ck.save(1, {"w": torch.ones(10)})
        options = json.dumps({"faults": name})
        assert main(["verify", url, "--storage-options", options]) == 0
        assert capsys.readouterr().out == "step 1: ok (1 rank)\n"
        faults.fail(ConnectionRefusedError, ops={"read"})
        assert main(["verify", url, "--storage-options", options, "--timeout", "0.5"]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith("tiercheck: verify stopped (ConnectionRefusedError: ")
        assert f": {url}: check the store and retry" in err
    finally:
        faults.heal()
        FaultyMemoryFileSystem(skip_instance_cache=True).clear_under(f"/{name}")
