"""`python -m trainer`: one config, no study."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_trainer(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_trains_a_yaml_config(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("task: digits\nmax_steps: 40\neval_every_steps: 20\nmodel: {hidden: 32}\n")
    done = run_trainer(config, "--set", "learning_rate=0.01")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "completed" and result["steps"] == 40
    assert set(result["metrics"]) == {"val_loss", "val_accuracy"}
    assert "eval 20:" in done.stderr


def test_bad_config_exits_2_naming_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("task: digits\noptimiser: adam\n")
    done = run_trainer(config)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"{config}: optimiser: unknown key")
    assert done.stdout == ""
