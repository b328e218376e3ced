"""A newcomer's layout: their own task in a package next to the study file, run from another folder."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import TINY_STUDY, run_cli, sweep_cli

TASK = '''
import torch
from torch import nn
from trainer.tasks import Task


def spirals(n: int = 400) -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()
    return Task(name="spirals", train=(x[:320], y[:320]), val=(x[320:], y[320:]), model_defaults={"hidden": 16},
                build_model=lambda cfg: nn.Sequential(nn.Linear(2, cfg["hidden"]), nn.ReLU(),
                                                      nn.Linear(cfg["hidden"], 2)))
'''


def test_a_task_package_next_to_the_study_file_is_found_from_any_working_folder(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "newcomer_tasks").mkdir(parents=True)
    (project / "newcomer_tasks" / "__init__.py").write_text("")
    (project / "newcomer_tasks" / "spirals.py").write_text(TASK)
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "task": "newcomer_tasks.spirals:spirals"}
    document["space"] = {"learning_rate": document["space"]["learning_rate"]}
    (project / "study.yaml").write_text(yaml.safe_dump(document))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        done = sweep_cli("run", project / "study.yaml", cwd=elsewhere)
        assert done.returncode == 0, done.stderr
        assert "2/2 trials" in done.stdout
        # Its database alone, the task trusted: found beside the database as beside the study file, from any folder
        # (it needed PYTHONPATH). A fresh interpreter: this one has imported the task already.
        again = run_cli("reproduce", project / "tiny.db", "1", "--trust-task", cwd=elsewhere)
        assert again.returncode == 0, again.stderr
        assert "reproduced" in again.stdout
        # `sweep best -o` elsewhere: its header's command line runs there (the task is beside the study, not there).
        assert sweep_cli("best", project / "study.yaml", "-o", elsewhere / "best.yaml").returncode == 0
        header = (elsewhere / "best.yaml").read_text().splitlines()[0]
        assert re.search(rf"PYTHONPATH={re.escape(str(project))} OMP_NUM_THREADS=\d+ python -m trainer "
                         rf"{re.escape(str(elsewhere / 'best.yaml'))}$", header), header
        trained = subprocess.run([sys.executable, "-m", "trainer", str(elsewhere / "best.yaml")], cwd=elsewhere,
                                 env={**os.environ, "PYTHONPATH": str(project)}, capture_output=True, text=True,
                                 timeout=300)
        assert trained.returncode == 0, trained.stderr
    finally:
        for name in [m for m in sys.modules if m.startswith("newcomer_tasks")]:
            del sys.modules[name]


def test_a_task_module_that_cannot_be_found_says_where_to_put_it(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"task": "nowhere_to_be_found.tasks:spirals"}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(document))
    done = sweep_cli("run", tmp_path / "study.yaml")
    assert done.returncode == 2
    assert "next to the study file" in done.stderr and "nowhere_to_be_found" in done.stderr
    assert "Traceback" not in done.stderr


NESTED_TASK = '''
import torch
from torch import nn
from trainer.tasks import Task


def task() -> Task:
    def build(cfg):  # every key of each nested default is read: a sibling default dropped would raise KeyError
        enc, head = cfg["enc"], cfg["head"]
        act = nn.ReLU() if enc["act"] == "relu" else nn.Tanh()
        return nn.Sequential(nn.Linear(6, enc["width"]), act, nn.Dropout(head["drop"]), nn.Linear(enc["width"], 2))
    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(0))
    y = (x.sum(dim=1) > 0).long()
    return Task(name="nested", train=(x[:64], y[:64]), val=(x[64:], y[64:]), build_model=build,
                model_defaults={"enc": {"width": 16, "act": "relu"}, "head": {"drop": 0.0}})
'''


def test_a_nested_model_default_is_fixed_and_searched_key_by_key(tmp_path: Path) -> None:
    # Found by review: fixing `model.enc.width` replaced the whole `enc` default, so every trial failed with
    # KeyError: 'act' after the study file was accepted, and `model.enc.width` could not be searched at all. A
    # default that is a mapping now names its keys as the defaults do: each is fixed or searched on its own, the
    # others keep their defaults, and a key it does not name is refused on its line before any trial runs.
    (tmp_path / "nested_task.py").write_text(NESTED_TASK)
    document = copy.deepcopy(TINY_STUDY) | {"name": "nested", "n_trials": 3, "task": {"name": "nested_task:task"}}
    document["fixed"] = {**document["fixed"], "model.enc.width": 8}
    document["space"] = {"learning_rate": document["space"]["learning_rate"],
                         "model.enc.act": {"type": "categorical", "choices": ["relu", "tanh"]},
                         "model.head.drop": {"type": "float", "low": 0.0, "high": 0.3}}
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump(document))
    done = sweep_cli("run", study, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("complete value=") == 3, done.stderr
    best = sweep_cli("best", study, pythonpath=tmp_path)
    model = yaml.safe_load(best.stdout)["model"]
    assert model["enc"]["width"] == 8 and model["enc"]["act"] in ("relu", "tanh") and "drop" in model["head"], model

    document["space"]["model.enc.widht"] = document["space"].pop("model.enc.act")
    study.write_text(yaml.safe_dump(document))
    refused = sweep_cli("run", study, pythonpath=tmp_path)
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "space.model.enc.widht: unknown key for task 'nested'" in line and "model.enc.width" in line, line
    document["space"].pop("model.enc.widht")
    document["fixed"]["model.enc.depth"] = 2
    study.write_text(yaml.safe_dump(document))
    refused = sweep_cli("run", study, pythonpath=tmp_path)
    assert refused.returncode == 2 and "model.enc.depth: unknown key for task 'nested'" in refused.stderr, \
        refused.stderr
