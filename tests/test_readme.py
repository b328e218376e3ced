"""The README is the reference for study files and configs: it must name every key the code accepts."""

from __future__ import annotations

from pathlib import Path

from sweep.spec import StudySpec
from sweep.study import PRUNERS, SAMPLERS
from trainer import TrainingConfig

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_training_config_key_is_documented() -> None:
    missing = [key for key in TrainingConfig.keys() if f"| `{key}` |" not in README]
    assert missing == []


def test_every_study_file_key_sampler_and_pruner_is_documented() -> None:
    missing = [key for key in StudySpec.model_fields if f"| `{key}` |" not in README]
    missing += [name for name in (*SAMPLERS, *PRUNERS) if f"`{name}`" not in README]
    assert missing == []


def test_shipped_studies_open_with_the_command_that_runs_them() -> None:
    for path in sorted((Path(__file__).resolve().parent.parent / "studies").glob("*.yaml")):
        assert path.read_text().startswith(f"# sweep run studies/{path.name}\n"), path
