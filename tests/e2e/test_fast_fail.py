"""Fast-fail on real training runs, through the real CLI."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import TINY_STUDY, CliResult, sweep_cli, write_study
from trainer import TrainingConfig, train

DIVERGING = {"optimizer": "sgd", "learning_rate": 100.0, "scheduler": "none", "model": {"hidden": 64}}


def sweep(path: Path, *args: str, pythonpath: Path | None = None) -> CliResult:
    return sweep_cli("run", path, *args, pythonpath=pythonpath)


def test_a_diverging_learning_rate_is_pruned_within_one_check_interval(tmp_path: Path) -> None:
    # Where does this config diverge? The same run alone, fast-fail off, reading the loss at every step.
    alone = train(TrainingConfig.from_dict({**DIVERGING, "max_steps": 30, "log_every_steps": 1,
                                            "eval_every_steps": 1000, "fast_fail": {"enabled": False}}))
    threshold = 10 * 2.35  # the explosion reference is the untrained model's validation loss, about 2.3
    diverged_at = next(r["step"] for r in alone.logs if not math.isfinite(r["train_loss"]) or
                       r["train_loss"] > threshold)
    assert diverged_at < 10

    document = copy.deepcopy(TINY_STUDY) | {
        "n_trials": 1, "space": {"momentum": {"type": "categorical", "choices": [0.9]}},
        "pruner": {"type": "fastfail", "warmup_steps": 0, "then": "median"}}
    document["fixed"] = {**DIVERGING, "max_steps": 400, "eval_every_steps": 100, "log_every_steps": 5,
                         "batch_size": 64}
    path = write_study(tmp_path, document)
    done = sweep(path)
    assert done.returncode == 0, done.stderr
    [trial] = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert trial.state == TrialState.PRUNED
    reason = trial.user_attrs["prune_reason"]
    assert reason["rule"] == "explode"
    assert 0 <= reason["step"] - diverged_at < 5  # within one check interval (the log interval, 5 steps)
    assert reason["step"] < 100  # long before the first scheduled evaluation
    assert reason["train_loss"] > threshold and reason["value"] > 10 * reason["initial"]
    assert trial.user_attrs["steps"] == reason["step"]
    assert f"pruned: exploded at step {reason['step']}" in done.stderr
    assert sorted(trial.intermediate_values) == [0, reason["step"]]



def test_a_diverged_trial_is_pruned_as_exploded_when_the_study_maximises_accuracy(tmp_path: Path) -> None:
    # Maximising val_accuracy, a learning rate that blew the loss up (val_loss 11.6 from 2.3) ran its whole budget at
    # chance accuracy: the explosion rule reads a loss, and the accuracy is none. Fast-fail reads the trial's
    # val_loss curve too (`loss_curve`), for its NaN/Inf and explosion rules; the learner is left alone.
    document = copy.deepcopy(TINY_STUDY) | {
        "n_trials": 2, "direction": "maximize", "metric": "val_accuracy", "pruner": "fastfail",
        "sampler": {"type": "bruteforce"},
        "space": {"learning_rate": {"type": "categorical", "choices": [1000.0, 0.1]}}}
    document["fixed"] = {"optimizer": "sgd", "scheduler": "none", "max_steps": 200, "eval_every_steps": 20,
                         "log_every_steps": 10, "batch_size": 64}
    done = sweep(write_study(tmp_path, document))
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    by_lr = {t.params["learning_rate"]: t for t in trials}
    diverged, learner = by_lr[1000.0], by_lr[0.1]
    assert diverged.state == TrialState.PRUNED, diverged.user_attrs.get("metrics")
    reason = diverged.user_attrs["prune_reason"]
    assert reason["rule"] == "explode" and reason["of"] == "val_loss" and reason["step"] < 20, reason
    assert f"pruned: val_loss exploded at step {reason['step']}" in done.stderr
    assert learner.state == TrialState.COMPLETE and learner.value > 0.5


@pytest.mark.parametrize("pruner", ["fastfail", "none"])
def test_a_model_gone_nan_is_stopped_whatever_the_metric(tmp_path: Path, pruner: str) -> None:
    """Maximising val_accuracy: a model whose weights went NaN still has an accuracy (the argmax picks a class), and
    it completed, ranked among the best and lent its weights to warm starts. Its metric counts as NaN once its
    val_loss is: fast-fail's `nan` rule prunes it, and without a pruner it fails as diverged."""
    document = copy.deepcopy(TINY_STUDY) | {
        "n_trials": 1, "direction": "maximize", "metric": "val_accuracy", "pruner": pruner,
        "space": {"learning_rate": {"type": "categorical", "choices": [1e30]}}}
    document["fixed"] = {"optimizer": "sgd", "scheduler": "none", "max_steps": 60, "eval_every_steps": 20,
                         "log_every_steps": 5, "batch_size": 32}
    path = write_study(tmp_path, document)
    done = sweep(path)
    [trial] = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert math.isnan(float(trial.user_attrs["metrics"]["val_loss"]))  # stored as the text "nan"
    if pruner == "fastfail":
        assert done.returncode == 0, done.stderr
        assert trial.state == TrialState.PRUNED and trial.user_attrs["prune_reason"]["rule"] == "nan"
        assert trial.user_attrs["steps"] < 20  # the loop's guard brought the evaluation forward
    else:
        assert done.returncode == 1  # every trial failed
        assert trial.state == TrialState.FAIL
        assert trial.user_attrs["fail_reason"] == "diverged: val_accuracy is nan at step 60"

def test_nan_in_the_data_stops_the_study_instead_of_burning_its_budget(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(
        "from trainer.tasks import digits\n"
        "def task():\n"
        "    t = digits()\n"
        "    t.train[0][:, 5] = float('nan')  # every training batch (NaN in validation data is refused at once)\n"
        "    return t\n")
    document = copy.deepcopy(TINY_STUDY) | {"task": "broken:task", "n_trials": 10, "max_repeated_failures": 3}
    del document["pruner"]  # the default: fast-fail wrapping median
    path = write_study(tmp_path, document)
    done = sweep(path, pythonpath=tmp_path)
    assert done.returncode == 1
    assert "3 trials in a row failed the same way (nan at step 10)" in done.stderr, done.stderr
    assert "the code or the data is likely broken" in done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert len(trials) == 3 and all(t.state == TrialState.PRUNED for t in trials)
    assert all(t.user_attrs["prune_reason"]["rule"] == "nan" for t in trials)
    assert "Fix it and rerun, or raise max_repeated_failures." in done.stderr  # 3 of 10 spent: a rerun goes on
    # Failures that spend the whole budget: "Fix it and rerun" trained nothing, as the rerun found it spent.
    spent = write_study(tmp_path, document | {"name": "spent", "n_trials": 3}, name="spent.yaml")
    done = sweep(spent, pythonpath=tmp_path)
    assert done.returncode == 1
    assert ("Fix it, then rerun with a larger --n-trials: these failures spent the budget (3/3 trials done), so a "
            "rerun alone trains nothing.") in done.stderr, done.stderr


def test_a_broken_model_whose_error_holds_each_config_s_numbers_stops_the_study(tmp_path: Path) -> None:
    """Found by review: a bug that fails every config with the config's own numbers in its message (here a layer one
    input short, whose shape error names each trial's width) was never "the same way" twice, so the study spent its
    whole budget failing. The numbers are left out of the comparison; the line shows the last failure as it was."""
    (tmp_path / "shapebug.py").write_text(  # a module name of its own: tests in this process imported "broken"
        "import dataclasses\n"
        "from torch import nn\n"
        "from trainer.tasks import digits\n"
        "def task():\n"
        "    def build(cfg):  # its first layer takes 63 inputs, where digits' samples have 64\n"
        "        return nn.Sequential(nn.Linear(63, cfg['hidden']), nn.ReLU(), nn.Linear(cfg['hidden'], 10))\n"
        "    return dataclasses.replace(digits(), build_model=build)\n")
    document = copy.deepcopy(TINY_STUDY) | {"task": "shapebug:task", "n_trials": 10, "max_repeated_failures": 3}
    done = sweep(write_study(tmp_path, document), pythonpath=tmp_path)
    assert done.returncode == 1, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert len(trials) == 3 and all(t.state == TrialState.FAIL for t in trials)
    widths = {t.params["model.hidden"] for t in trials}
    assert len(widths) > 1, widths  # messages that differ: RuntimeError: ... (32x64 and 63xWIDTH)
    last = trials[-1].user_attrs["fail_reason"]
    assert last.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), last
    assert f"3 trials in a row failed the same way ({last}); the code or the data is likely broken" in done.stderr


# A model that cannot be built wider than 16: one region of the search space fails, with its width in the message.
NARROW_MODEL = (
    "import dataclasses\n"
    "from pathlib import Path\n"
    "from torch import nn\n"
    "from trainer.tasks import digits\n"
    "def task():\n"
    "    def build(cfg):\n"
    "        if (Path(__file__).parent / 'broken').exists():  # edited since: one input short, for every width\n"
    "            return nn.Sequential(nn.Linear(63, cfg['hidden']), nn.ReLU(), nn.Linear(cfg['hidden'], 10))\n"
    "        if cfg['hidden'] > 16:\n"
    "            raise ValueError(f\"hidden {cfg['hidden']} unsupported\")\n"
    "        return nn.Sequential(nn.Linear(64, cfg['hidden']), nn.ReLU(), nn.Linear(cfg['hidden'], 10))\n"
    "    return dataclasses.replace(digits(), build_model=build)\n")


@pytest.mark.parametrize("first", ["trains", "fails", "trained in an earlier run"])
def test_a_region_of_the_space_that_fails_with_its_own_numbers_is_told_from_broken_code(
        tmp_path: Path, first: str) -> None:
    """Found by review: failures whose messages differ only in their numbers count as "the same way", so a model that
    cannot be built wider than 16 ("hidden 17 unsupported") stopped the study at five such trials in a row, as broken
    code, where half the range trains. Once a trial of the run has trained, the numbers count; before that, the
    stop line names the searched values the failures differ in. A trial an earlier run trained says nothing of code
    edited since (diff review: a model broken for every width then spent the whole budget)."""
    from sweep.spec import parse_spec
    from sweep.study import open_study

    module = f"narrow_{first.replace(' ', '_')}"
    (tmp_path / f"{module}.py").write_text(NARROW_MODEL)
    document = copy.deepcopy(TINY_STUDY) | {"task": f"{module}:task", "n_trials": 5, "max_repeated_failures": 3,
                                            "sampler": {"type": "random"}}
    document["space"] = {"model.hidden": {"type": "int", "low": 8, "high": 32}}
    path = write_study(tmp_path, document)
    sys.path.insert(0, str(tmp_path))
    try:  # (a module name of each case's own: the tests share one process's imports)
        study = open_study(parse_spec(document, path), f"sqlite:///{tmp_path / 'tiny.db'}")
    finally:
        sys.path.remove(str(tmp_path))
    if first == "trained in an earlier run":
        study.enqueue_trial({"model.hidden": 8})
        assert sweep(path, "--n-trials", "1", pythonpath=tmp_path).returncode == 0
        (tmp_path / "broken").touch()
    widths = ([8] if first == "trains" else []) + [17, 18, 19, 20]
    for width in widths:
        study.enqueue_trial({"model.hidden": width})
    done = sweep(path, pythonpath=tmp_path)
    states = [t.state for t in optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
              .get_trials()]
    if first == "trained in an earlier run":
        assert done.returncode == 1, done.stderr
        assert states == [TrialState.COMPLETE] + [TrialState.FAIL] * 3 + [TrialState.WAITING], states
        assert "3 trials in a row failed the same way (RuntimeError: mat1 and mat2 shapes" in done.stderr, done.stderr
    elif first == "trains":
        assert done.returncode == 0, done.stderr
        assert states == [TrialState.COMPLETE] + [TrialState.FAIL] * 4, states
        assert "in a row" not in done.stderr, done.stderr
    else:
        assert done.returncode == 1, done.stderr
        assert states == [TrialState.FAIL] * 3 + [TrialState.WAITING], states  # the fourth never asked
        assert ("3 trials in a row failed the same way (ValueError: hidden 19 unsupported); the code or the data is "
                "likely broken, or these values of model.hidden (17, 18, 19) fail (no trial has trained yet: narrow "
                "the space if others train)") in done.stderr, done.stderr


def test_a_trial_another_worker_of_the_run_trained_keeps_the_failures_numbers(tmp_path: Path) -> None:
    """Found by diff review: with `--workers 2`, one worker trained a trial while the other failed three in a row in
    a region of the space ("hidden 17 unsupported"), and that worker stopped the study as broken code, saying no
    trial had trained. A trial of the run trained by any worker counts. (Here the failing builds wait until the
    study holds a completed trial, so the order is the reviewer's whatever the machine's load.)"""
    from sweep.spec import parse_spec
    from sweep.study import open_study

    (tmp_path / "narrow_waiting.py").write_text(
        "import dataclasses, time\n"
        "from pathlib import Path\n"
        "import optuna\n"
        "from torch import nn\n"
        "from trainer.tasks import digits\n"
        "def task():\n"
        "    def build(cfg):\n"
        "        if cfg['hidden'] > 16:\n"
        "            storage = f\"sqlite:///{Path(__file__).parent / 'tiny.db'}\"\n"
        "            deadline = time.monotonic() + 300\n"
        "            while time.monotonic() < deadline and not optuna.load_study(study_name='tiny', storage=storage)"
        ".get_trials(states=(optuna.trial.TrialState.COMPLETE,)):\n"
        "                time.sleep(0.1)\n"
        "            raise ValueError(f\"hidden {cfg['hidden']} unsupported\")\n"
        "        return nn.Sequential(nn.Linear(64, cfg['hidden']), nn.ReLU(), nn.Linear(cfg['hidden'], 10))\n"
        "    return dataclasses.replace(digits(), build_model=build)\n")
    document = copy.deepcopy(TINY_STUDY) | {"task": "narrow_waiting:task", "n_trials": 10, "max_repeated_failures": 3,
                                            "sampler": {"type": "random"}}
    document["space"] = {"model.hidden": {"type": "int", "low": 8, "high": 32}}
    path = write_study(tmp_path, document)
    sys.path.insert(0, str(tmp_path))
    try:
        study = open_study(parse_spec(document, path), f"sqlite:///{tmp_path / 'tiny.db'}")
    finally:
        sys.path.remove(str(tmp_path))
    for width in (8, *range(17, 26)):  # one that trains, then nine failures: at least four for each worker
        study.enqueue_trial({"model.hidden": width})
    done = sweep(path, "--workers", "2", pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    states = [t.state for t in optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
              .get_trials()]
    assert sorted(states, key=str) == sorted([TrialState.COMPLETE] + [TrialState.FAIL] * 9, key=str), states
    assert "in a row" not in done.stderr, done.stderr


def test_the_trainer_alone_applies_the_same_rules(tmp_path: Path) -> None:
    result = train(TrainingConfig.from_dict({**DIVERGING, "max_steps": 400, "eval_every_steps": 100,
                                             "log_every_steps": 5, "fast_fail": {"warmup_steps": 0}}))
    assert result.status == "stopped" and result.stop_reason["rule"] == "explode"
    assert result.steps < 100


# Few training samples (10% of digits), a wide model and a high learning rate: validation loss bottoms out within about
# 70 steps and then climbs while the training loss goes on to ~0.003.
OVERFITTING = {"task_args": {"val_fraction": 0.9}, "learning_rate": 0.01, "model": {"hidden": 64}, "max_steps": 300,
               "eval_every_steps": 10, "log_every_steps": 10, "batch_size": 32}


def test_an_overfitting_trial_is_pruned_by_the_overfitting_rule_with_its_reason(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {
        "n_trials": 1, "space": {"momentum": {"type": "categorical", "choices": [0.9]}},
        "pruner": {"type": "fastfail", "overfit_gap": 0.2, "overfit_patience_steps": 50, "then": "none"}}
    document["fixed"] = {k: v for k, v in OVERFITTING.items() if k != "task_args"}
    document["task"] = {"name": "digits", "args": OVERFITTING["task_args"]}
    done = sweep(write_study(tmp_path, document))
    assert done.returncode == 0, done.stderr
    [trial] = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert trial.state == TrialState.PRUNED, trial.intermediate_values
    reason = trial.user_attrs["prune_reason"]
    assert reason["rule"] == "overfit" and reason["gap"] > 0.2
    assert reason["step"] - max(reason["since"], reason["best_step"]) >= 50
    assert reason["value"] > reason["best"] == min(trial.intermediate_values.values())
    train_curve = dict(trial.user_attrs["train_curve"])  # what the pruner judged, kept on the trial
    assert sorted(int(s) for s in train_curve) == [s for s in sorted(trial.intermediate_values) if s > 0]
    assert f"pruned: overfit at step {reason['step']}" in done.stderr


def test_the_same_run_completes_with_the_overfitting_rule_off(tmp_path: Path) -> None:
    config = {**OVERFITTING, "fast_fail": {"loss_explosion_factor": None, "patience_steps": 0}}
    alone = train(TrainingConfig.from_dict(config))
    assert alone.status == "completed" and alone.steps == 300
    best = min(m["val_loss"] for _, m in alone.evals)
    assert alone.metrics["val_loss"] > 1.05 * best  # it did overfit: the rule being off is what let it finish
    stopped = train(TrainingConfig.from_dict({**config, "fast_fail": {**config["fast_fail"], "overfit_gap": 0.2,
                                                                         "overfit_patience_steps": 50}}))
    assert stopped.status == "stopped" and stopped.stop_reason is not None
    assert stopped.stop_reason["rule"] == "overfit" and stopped.steps < 300
