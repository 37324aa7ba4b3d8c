"""`make`'s own set-up (tools/setup-venv.sh): a failed step is named and trusted by nothing.

The successful path is what CI runs itself (`.ci/run` is `make lint test` on a clean clone).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "setup-venv.sh"


def _setup(venv: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(venv)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_too_old_python_is_named_before_anything_is_made(tmp_path):
    # A Python that reports itself as 3.9 to every `-c` program the script runs.
    fake = tmp_path / "python3.9"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'[ "$1" = -c ] && exec {sys.executable} -c "import sys; sys.version_info = (3, 9, 0); $2"\n'
        "exit 1\n"
    )
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    result = _setup(venv, PYTHON=str(fake))
    assert result.returncode != 0
    assert "step 1/4" in result.stderr and "3.9" in result.stderr and ">= 3.10" in result.stderr
    assert not venv.exists()


@pytest.mark.slow
def test_failed_install_names_the_step_and_removes_the_half_made_venv(tmp_path):
    # No package index and no local wheels: the torch step cannot succeed.
    venv = tmp_path / "venv"
    env = {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path),
        "TORCH_CPU_INDEX": "http://127.0.0.1:9",  # nothing listens on the discard port
        "PYTHON": sys.executable,
    }
    result = _setup(venv, **env)
    assert result.returncode != 0, result.stdout
    assert "step 3/4 (install torch" in result.stderr, result.stderr
    assert "removed the half-made" in result.stderr
    assert not venv.exists()
