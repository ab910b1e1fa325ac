from __future__ import annotations

from pathlib import Path

import pytest
from run_folders import write_demo_folder


@pytest.fixture
def demo_folder(tmp_path: Path) -> Path:
    """runs/demo as the demo lays it out: train/ (simulated RL) and live/cycles/ (two real-time RL cycles)."""
    return write_demo_folder(tmp_path / "demo")
