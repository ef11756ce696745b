"""The weights broadcast example runs end to end on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "weights_broadcast.py"


def test_weights_broadcast_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "every reader ended on the trainer's last weights" in out
    for i in range(3):
        assert f"inference {i}: done" in out
