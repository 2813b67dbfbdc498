"""The trainer integrations are optional: tiercheck imports, saves and restores without
Lightning or Accelerate, and importing an integration without its framework says what to
install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FRAMEWORKS = ("pytorch_lightning", "lightning", "lightning_fabric", "accelerate")
BLOCK = f"import sys\nfor m in {FRAMEWORKS!r}:\n    sys.modules[m] = None\n"  # an import of one fails


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO, timeout=300
    )


def test_tiercheck_works_without_the_frameworks(tmp_path: Path) -> None:
    proc = run(
        f"""
        import torch, tiercheck
        with tiercheck.Checkpointer(local={str(tmp_path)!r}) as c:
            c.save(1, {{"w": torch.ones(3)}}, metrics={{"loss": 0.5}}).wait()
            assert c.metrics(1) == {{"loss": 0.5}}
        assert not any(m.startswith(("pytorch_lightning", "accelerate")) and sys.modules[m] for m in sys.modules)
        import tiercheck.integrations
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_an_integration_without_its_framework_says_what_to_install() -> None:
    proc = run(
        """
        try:
            import tiercheck.integrations.lightning
        except ImportError as exc:
            print(exc)
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pip install tiercheck[lightning]" in proc.stdout
