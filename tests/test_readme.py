"""The README is the reference for study files and configs: it must name every key the code accepts."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import optuna
import pytest

from sweep.spec import StudyFileError, StudySpec, load_spec
from sweep.study import PRUNERS, SAMPLERS
from tests.conftest import TINY_STUDY, write_study
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


ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_s_complete_example_is_the_quickstart_file_itself() -> None:
    start = README.index("A complete example (`studies/quickstart.yaml`):\n\n```yaml\n")
    block = README[start:].split("```yaml\n", 1)[1].split("```", 1)[0]
    shipped = "".join(line for line in (ROOT / "studies" / "quickstart.yaml").read_text().splitlines(keepends=True)
                      if not line.startswith("#"))
    assert block == shipped


def shown_run_commands() -> list[tuple[str, list[str]]]:
    """Every `sweep run FILE [--set k=v ...]` the README or a study file's header shows: (command, words)."""
    texts = [README, *(path.read_text() for path in sorted((ROOT / "studies").glob("*.yaml")))]
    found = []
    for text in texts:
        for match in re.finditer(r"sweep run (studies/[\w.-]+\.yaml)((?: --[\w-]+(?:[ =][^\s`#]+)?)*)", text):
            found.append((match.group(0), shlex.split(match.group(0))[2:]))
    return found


def test_every_shown_sweep_run_command_is_valid_as_written() -> None:
    """Each shown `sweep run` command's study file, with its `--set` values, passes every check `sweep run` makes
    before its first trial (the whole run is not started: some are GPU-sized)."""
    commands = shown_run_commands()
    assert len(commands) >= 5
    problems = []
    for text, words in commands:
        path, overrides = ROOT / words[0], []
        for i, word in enumerate(words):
            if word == "--set":
                overrides.append(words[i + 1])
            elif word.startswith("--set="):
                overrides.append(word.removeprefix("--set="))
        try:
            load_spec(path, overrides)
        except StudyFileError as exc:
            problems.append(f"{text}: {exc}")
    assert problems == []


def test_the_readme_s_python_example_runs_a_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "From Python" block as written, run here on a tiny study in the quickstart's place."""
    start = README.index("From Python (a notebook, a script)")
    block = README[start:].split("```python\n", 1)[1].split("```", 1)[0]
    assert '"studies/quickstart.yaml"' in block
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY))
    monkeypatch.chdir(tmp_path)
    exec(block.replace('"studies/quickstart.yaml"', repr(str(path))), {})  # the README's own code
    study = optuna.load_study(study_name=TINY_STUDY["name"], storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * TINY_STUDY["n_trials"]
