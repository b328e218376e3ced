"""Bad study files: each exits with code 2 and one clear line naming the file, the key and what was expected, and
nothing is written to the storage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sweep.spec import StudyFileError, load_spec
from tests.conftest import TINY_STUDY, changed, run_cli, sweep_cli, write_study

LR = "learning_rate"
BAD_FILES = [
    pytest.param(changed(n_trails=3), "n_trails", "unknown key", id="unknown-top-level-key"),
    pytest.param(changed(fixed__max_step=10), "fixed.max_step", "unknown key", id="unknown-config-key"),
    pytest.param(changed(space__learning_rate={"type": "float", "low": 0.1, "high": 0.01}), f"space.{LR}",
                 "low <= high", id="low-above-high"),
    pytest.param(changed(space__learning_rate={"type": "float", "low": 0, "high": 0.1, "log": True}), f"space.{LR}",
                 "log: true needs low > 0", id="log-with-low-zero"),
    pytest.param(changed(space__optimizer={"type": "categorical", "choices": []}), "space.optimizer.choices",
                 "at least 1 item", id="empty-choices"),
    pytest.param(changed(space__optimizer={"type": "categorical", "choices": ["adam", "rmsprop"]}),
                 "space.optimizer.choices[1]", "'adam', 'adamw', 'sgd', 'lion'", id="unknown-optimizer-choice"),
    pytest.param(changed(fixed__optimizer="rmsprop"), "fixed.optimizer", "'adamw'", id="unknown-optimizer-fixed"),
    pytest.param(changed(n_trials="many"), "n_trials", "valid integer", id="wrong-type"),
    pytest.param(changed(fixed__batch_size="big"), "fixed.batch_size", "expected an integer", id="wrong-type-config"),
    pytest.param(changed(task=...), "task", "required key is missing", id="missing-task"),
    pytest.param(changed(task="mnist"), "task", "unknown task 'mnist'", id="unknown-task"),
    pytest.param(changed(space__lr={"type": "float", "low": 0.1, "high": 1}), "space.lr",
                 "not a searchable TrainingConfig key", id="unknown-space-key"),
    pytest.param(changed(space__model__hidden=None, fixed__model={"hidden": 4},
                         space={"model.hidden": {"type": "int", "low": 8, "high": 32}}),
                 "space.model.hidden", "both fixed (fixed.model.hidden) and searched", id="fixed-and-searched"),
    pytest.param(changed(space={"model.width": {"type": "int", "low": 8, "high": 32}}),
                 "space.model.width", "unknown key for task 'digits'", id="unknown-model-key"),
    pytest.param(changed(space={"warmup_steps": {"type": "float", "low": 0, "high": 5}}),
                 "space.warmup_steps.type", "use type: int", id="float-for-int-key"),
    pytest.param(changed(space={"curriculum.stages": {"type": "float", "low": 2, "high": 5}}),
                 "space.curriculum.stages.type", "use type: int", id="float-for-nested-int-key"),
    pytest.param(changed(space__learning_rate={"type": "floot", "low": 1, "high": 2}), f"space.{LR}.type",
                 "unknown type 'floot' (did you mean 'float'?); expected one of float, int, categorical",
                 id="unknown-param-type"),
    pytest.param(changed(metric="val_acuracy"), "metric", "val_loss, val_accuracy", id="metric-not-reported"),
    pytest.param(changed(sampler={"type": "tpe", "n_startup": 3}), "sampler.n_startup",
                 "unknown argument of TPESampler", id="unknown-sampler-arg"),
    pytest.param(changed(pruner="mediann"), "pruner.type", "unknown pruner 'mediann'", id="unknown-pruner"),
    pytest.param(changed(pruner={"type": "percentile", "percentile": 200}), "pruner.percentile", "PercentilePruner",
                 id="bad-pruner-value"),
    # Optuna's own checks name their argument in words: the key is found in them, and the value given added.
    pytest.param(changed(sampler={"type": "random", "seed": -5}), "sampler.seed",
                 "RandomSampler: Seed must be between 0 and 2**32 - 1 (got -5)", id="optuna-s-check-names-the-key"),
    pytest.param(changed(pruner={"type": "patient", "patience": -1, "wrapped": "median"}), "pruner.patience",
                 "PatientPruner: patience cannot be negative but got -1.", id="optuna-s-check-quotes-the-value"),
    pytest.param(changed(metric="val_accuracy", direction="maximize",
                         pruner={"type": "fastfail", "overfit_gap": 0.1}), "pruner.overfit_gap",
                 "needs metric val_loss, got 'val_accuracy'", id="overfit-rule-without-a-training-counterpart"),
    pytest.param(changed(pruner={"type": "fastfail", "overfit_gap": -1}), "pruner.overfit_gap",
                 "FastFailPruner: expected a gap >= 0",
                 id="negative-overfit-gap"),
    pytest.param(changed(tracking={"tensorbord": True}), "tracking.tensorbord", "unknown key",
                 id="tracking-typo"),
    pytest.param(changed(tracking={"mlflow": {"tracking_url": "http://x"}}), "tracking.mlflow.tracking_url",
                 "unknown key", id="mlflow-typo"),
    pytest.param(changed(checkpoints={"every_seconds": 0}), "checkpoints.every_seconds", "greater than 0",
                 id="zero-every-seconds"),
    pytest.param(changed(direction="down"), "direction", "'minimize' or 'maximize'", id="bad-direction"),
    pytest.param(changed(heartbeat_interval=30, heartbeat_grace_period=40), "heartbeat_grace_period",
                 "at least twice heartbeat_interval (60 s)", id="grace-shorter-than-two-beats"),
    # A path or URL with a control character: NUL was a traceback ("embedded null byte") from every command, a
    # newline a folder no listing shows as named, or, in launch.slurm.log_dir, a command in the batch script.
    pytest.param(changed(checkpoints={"store": "a\0b"}), "checkpoints.store", "without control characters",
                 id="nul-in-store"),
    pytest.param(changed(checkpoints={"store": "a\nb"}), "checkpoints.store", "got 'a\\nb'", id="newline-in-store"),
    pytest.param(changed(storage="postgresql://u:hunter2@localhost/a\0b"), "storage",
                 "got 'postgresql://u:***@localhost/a\\x00b'", id="nul-in-storage-password-masked"),
    pytest.param(changed(storage="postgresql:/u:hunter2@localhost/a\nb"), "storage",  # one slash: still masked
                 "got 'postgresql:/u:***@localhost/a\\nb'", id="newline-in-collapsed-storage-url-masked"),
    pytest.param(changed(tracking={"tensorboard": {"dir": "t\0b"}}), "tracking.tensorboard.dir",
                 "without control characters", id="nul-in-tensorboard-dir"),
    pytest.param(changed(tracking={"mlflow": {"tracking_uri": "sqlite:///m\0.db"}}), "tracking.mlflow.tracking_uri",
                 "without control characters", id="nul-in-mlflow-uri"),
    pytest.param(changed(launch={"slurm": {"log_dir": "logs\ntouch /tmp/owned #"}}), "launch.slurm.log_dir",
                 "without control characters", id="newline-in-slurm-log-dir"),
    pytest.param(changed(checkpoints={"store": "ckpt\x85b"}), "checkpoints.store", "got 'ckpt\\x85b'",
                 id="c1-next-line-in-store"),  # U+0085 ends a line for many terminals and editors
    pytest.param(changed(storage_patience=float("nan")), "storage_patience", "expected a finite number, got nan",
                 id="nan-for-a-bound"),  # was "Input should be greater than 0, got nan"
    # A first rung no trial reaches (max_steps 20): accepted, and the pruner never pruned.
    pytest.param(changed(pruner={"type": "hyperband", "min_resource": 30}), "pruner.min_resource",
                 "30 is not below every trial's max_steps (20)", id="hyperband-rung-beyond-the-budget"),
    pytest.param(changed(pruner={"type": "fastfail", "then": {"type": "successive_halving", "min_resource": 21}}),
                 "pruner.then.min_resource", "nothing would be pruned", id="wrapped-halving-rung-beyond-the-budget"),
    # Review: Hyperband's brackets laid out up to 1000 steps in trials of 20: a fifth of the trials never judged.
    # (Brackets of min_resource 2, eta 3: first rungs 2, 6, 18, 54, 162, 486; 18 is the last within 20.)
    pytest.param(changed(pruner={"type": "hyperband", "min_resource": 2, "max_resource": 1000}),
                 "pruner.max_resource", "1000 gives Hyperband a bracket whose first rung is step 486, not below "
                 "every trial's max_steps (20): its trials would never be judged; expected under 54 (min_resource x "
                 "reduction_factor^k), or auto", id="hyperband-brackets-beyond-the-budget"),
    pytest.param(changed(pruner={"type": "hyperband", "max_resource": 27}), "pruner.max_resource",
                 "first rung is step 27, not below every trial's max_steps (20)", id="hyperband-a-bracket-at-27"),
    # A trial's last step is never judged (it completes): a first rung there is one no trial is judged at.
    pytest.param(changed(pruner={"type": "successive_halving", "min_resource": 20}), "pruner.min_resource",
                 "20 is not below every trial's max_steps (20)", id="halving-rung-at-the-last-step"),
    pytest.param(changed(fixed__max_steps=243, pruner={"type": "hyperband", "max_resource": 729}),
                 "pruner.max_resource", "first rung is step 729, not below every trial's max_steps (243): its trials "
                 "would never be judged; expected under 243", id="hyperband-budget-a-power-of-eta"),
]


@pytest.mark.parametrize(("document", "key", "fragment"), BAD_FILES)
def test_bad_study_file_is_refused_in_process(tmp_path: Path, document: dict, key: str, fragment: str) -> None:
    path = write_study(tmp_path, document)
    with pytest.raises(StudyFileError) as info:
        load_spec(path)
    assert [k for k, _ in info.value.problems] == [key], info.value.problems
    assert fragment in info.value.problems[0][1]
    assert info.value.lines()[0].startswith(f"{path}: {key}: ")


@pytest.mark.parametrize(("document", "line"), [
    pytest.param(changed(pruner={"type": "threshold", "upper": 1.0, "n_warmup_steps": 100}),
                 "pruner.n_warmup_steps: 100 is past the last step a trial is judged at (10: evaluations every 10 "
                 "steps, the last step, 20, completing the trial): threshold will prune nothing; set it to at most 10 "
                 "for it to judge",
                 id="threshold-warmup"),
    pytest.param(changed(pruner={"type": "median", "n_warmup_steps": 20}), "pruner.n_warmup_steps: 20 is past",
                 id="median-warmup-at-the-last-step"),
    # Diff review: evaluations at 5, 10, 15 of 20 steps: a warmup of 16 judges none of them either.
    pytest.param(changed(fixed__eval_every_steps=5, pruner={"type": "median", "n_warmup_steps": 16}),
                 "pruner.n_warmup_steps: 16 is past the last step a trial is judged at (15: evaluations every 5",
                 id="median-warmup-past-the-last-evaluation"),
    pytest.param(changed(pruner={"type": "patient", "patience": 1,
                                 "wrapped": {"type": "leaders", "n_warmup_steps": 20}}),
                 "pruner.wrapped.n_warmup_steps: 20 is past", id="leaders-warmup"),
    pytest.param(changed(pruner={"type": "fastfail", "then": {"type": "patient", "patience": 2, "wrapped": {
        "type": "percentile", "percentile": 50.0, "n_warmup_steps": 500}}}),
        "pruner.then.wrapped.n_warmup_steps: 500 is past", id="percentile-warmup-wrapped-twice"),
    pytest.param(changed(fixed__eval_every_steps=5, pruner={"type": "wilcoxon", "n_startup_steps": 50}),
                 "pruner.n_startup_steps: 50 is more than the 3 evaluations a trial reports before its last step (one "
                 "every eval_every_steps, of max_steps 20): wilcoxon will prune nothing; set it to at most 3 for it "
                 "to judge", id="wilcoxon-startup-past-the-evaluations"),
    pytest.param(changed(pruner={"type": "wilcoxon"}), "pruner: Wilcoxon judges a trial once it has reported 2 "
                 "evaluations, more than the 1 evaluation a trial reports", id="wilcoxon-one-evaluation"),
    # Diff review: a wrapped pruner given by its name alone (`then: wilcoxon`) is checked as its dict form is.
    pytest.param(changed(pruner={"type": "fastfail", "then": "wilcoxon"}), "pruner.then: Wilcoxon judges a trial "
                 "once it has reported 2 evaluations", id="wilcoxon-by-name-wrapped"),
    # README walk: the README's smoke test (quickstart with max_steps 50, an evaluation every 50) said nothing.
    pytest.param(changed(fixed__eval_every_steps=20, pruner={"type": "fastfail", "then": "median"}),
                 "pruner.then: median will prune nothing: a trial is evaluated at its start and at its last step "
                 "only (evaluations every 20 steps, the last step, 20, completing the trial); evaluate more often "
                 "(fixed.eval_every_steps) for it to judge", id="no-evaluation-before-the-last-step"),
])
def test_a_pruner_that_can_judge_no_trial_is_warned_of(tmp_path: Path, document: dict, line: str) -> None:
    """Review: a warmup past every trial's last step ran the study to the end and pruned nothing, without a word.
    Said, not refused: a short run of a study (`--set fixed.max_steps=50`, a smoke test) leaves its pruner nothing to
    do, and runs."""
    from sweep.spec import InertPruner

    with pytest.warns(InertPruner) as said:
        load_spec(write_study(tmp_path, document))
    [message] = [str(w.message) for w in said if w.category is InertPruner]
    assert message.startswith(line), message


@pytest.mark.parametrize("pruner", [
    {"type": "median", "n_warmup_steps": 15}, {"type": "wilcoxon"},
    {"type": "fastfail", "then": {"type": "percentile", "percentile": 50.0, "n_warmup_steps": 15}}])
def test_a_pruner_that_judges_at_the_last_evaluation_before_the_end_is_not_warned_of(
        tmp_path: Path, pruner: dict) -> None:
    import warnings

    from sweep.spec import InertPruner

    # max_steps 20, evaluations at 5, 10, 15 (20 completes the trial): a warmup of 15 judges the last of them, and
    # Wilcoxon has its 2 evaluations.
    document = changed(pruner=pruner, fixed__eval_every_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InertPruner)
        load_spec(write_study(tmp_path, document))


@pytest.mark.parametrize(
    ("document", "key"),
    [
        pytest.param(changed(fixed__max_step=10), "fixed.max_step", id="unknown-config-key"),
        pytest.param(changed(space__learning_rate={"type": "float", "low": 0.1, "high": 0.01}), "space.learning_rate",
                     id="low-above-high"),
        pytest.param(changed(task=...), "task", id="missing-task"),
        pytest.param(changed(checkpoints={"store": "a\0b"}), "checkpoints.store", id="nul-in-store"),
        pytest.param("name: [unclosed\n", "", id="invalid-yaml"),
        pytest.param("- a list\n", "", id="not-a-mapping"),
    ],
)
def test_bad_study_file_exits_2_and_writes_nothing(tmp_path: Path, document: dict | str, key: str) -> None:
    path = write_study(tmp_path, document)
    done = run_cli("run", path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {key}"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]  # no database was created


def test_unreadable_file_exits_2(tmp_path: Path) -> None:
    done = run_cli("run", tmp_path / "missing.yaml")
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path / 'missing.yaml'}: cannot read the study file: " \
                                  "No such file or directory"


def test_every_problem_is_reported_together(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed(n_trails=3, fixed__optimizer="rmsprop", metric="val_acuracy",
                                         space__learning_rate={"type": "float", "low": -1, "high": 1, "log": True}))
    with pytest.raises(StudyFileError) as info:
        load_spec(path)
    assert {k for k, _ in info.value.problems} == {"n_trails", "space.learning_rate"}  # structure first
    path = write_study(tmp_path, changed(fixed__optimizer="rmsprop", metric="val_acuracy",
                                         space__learning_rate={"type": "float", "low": -1, "high": 1}))
    with pytest.raises(StudyFileError) as info:
        load_spec(path)
    assert {k for k, _ in info.value.problems} == {"fixed.optimizer", "metric", "space.learning_rate.low"}


def test_overrides_and_defaults(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed(name=...))
    spec, resolved = load_spec(path, ["n_trials=7", "fixed.model.depth=2", "space.learning_rate.high=0.5"])
    assert spec.name == "study" and spec.n_trials == 7 and resolved == path.resolve()
    assert spec.fixed["model"] == {"depth": 2} and spec.space["learning_rate"].high == 0.5
    assert spec.sampler.type == "random" and spec.pruner.type == "none"
    config = spec.config_for({"learning_rate": 0.01})
    assert config.max_steps == 20 and config.model == {"depth": 2} and config.task == "digits"


@pytest.mark.parametrize(("override", "model"), [
    ("fixed.model.hidden=64", {"hidden": 64, "depth": 2}),
    ("fixed.model={hidden: 48}", {"hidden": 48}),  # the whole mapping, as for a nested key
    ("fixed.model.activation=gelu", {"hidden": 32, "depth": 2, "activation": "gelu"}),
])
def test_an_override_replaces_a_fixed_key_the_file_spells_dotted(tmp_path: Path, override: str, model: dict) -> None:
    # `fixed: {model.hidden: 32}` (a dotted key, which the README allows) and `--set fixed.model.hidden=64` were
    # refused as "fixed.model.hidden and fixed.model both set model.hidden".
    document = changed()
    del document["space"]["model.hidden"]
    document["fixed"] = {**document["fixed"], "model.hidden": 32, "model.depth": 2}
    spec, _ = load_spec(write_study(tmp_path, document), [override])
    assert spec.fixed["model"] == model and not any("." in key for key in spec.fixed)


def test_checkpoints_false_turns_them_off_and_true_keeps_the_defaults(tmp_path: Path) -> None:
    # `checkpoints: off` was "Input should be a valid dictionary ..., got False".
    off, _ = load_spec(write_study(tmp_path, changed(checkpoints=False)))
    on, _ = load_spec(write_study(tmp_path, changed(checkpoints=True), "on.yaml"))
    assert not off.checkpoints.enabled and on.checkpoints == load_spec(write_study(tmp_path, changed()))[0].checkpoints
    # A --set reaches inside either, as it does inside `tensorboard: true`.
    back, _ = load_spec(write_study(tmp_path, changed(checkpoints=False), "back.yaml"), ["checkpoints.every_steps=10"])
    assert back.checkpoints.every_steps == 10 and not back.checkpoints.on_best and back.checkpoints.enabled
    stored, _ = load_spec(write_study(tmp_path, changed(checkpoints=True), "s.yaml"), ["checkpoints.store=elsewhere"])
    assert stored.checkpoints.store == "elsewhere" and stored.checkpoints.on_best


def test_the_long_key_hint_is_given_for_the_line_yaml_stopped_at_only(tmp_path: Path) -> None:
    path = write_study(tmp_path, f"description: {'d' * 1100}\nmetric: a: b\n")
    with pytest.raises(StudyFileError) as info:
        load_spec(path)
    [(_, message)] = info.value.problems
    assert "line 2" in message and "1024" not in message, message


def test_overrides_reach_dotted_space_keys(tmp_path: Path) -> None:
    path = write_study(tmp_path, TINY_STUDY)  # searches model.hidden over 8..32
    spec, _ = load_spec(path, ["space.model.hidden.low=4", "space.model.depth={type: int, low: 1, high: 3}"])
    assert (spec.space["model.hidden"].low, spec.space["model.hidden"].high) == (4, 32)
    assert (spec.space["model.depth"].low, spec.space["model.depth"].high) == (1, 3)


def test_an_override_that_is_not_yaml_is_a_one_line_error(tmp_path: Path) -> None:
    path = write_study(tmp_path, TINY_STUDY)
    done = run_cli("run", path, "--set", "fixed.max_steps=[1,")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--set fixed.max_steps: expected a YAML value, but '[1,' is not one" in done.stderr
    assert not (tmp_path / "tiny.db").exists()


@pytest.mark.parametrize(("items", "line"), [
    (["n_trials=3", "n_trials=4"], "n_trials is set twice (3 and 4); keep one of them"),
    (["fixed.model.hidden=8", "fixed.model={hidden: 4}"],
     "--set fixed.model.hidden and --set fixed.model both set fixed.model.hidden; keep one of them"),
    (["pruner.n_startup_trials=1", "pruner=median"],
     "--set pruner would replace pruner.n_startup_trials, which --set pruner.n_startup_trials set before it; keep one "
     "of them"),
], ids=["twice", "same-value", "replaced"])
def test_two_sets_of_one_value_are_refused_as_a_file_s_two_keys_are(tmp_path: Path, items: list[str],
                                                                     line: str) -> None:
    """Found by review: the later `--set` silently won (a study trained `model: {hidden: 4}` with `--set
    fixed.model.hidden=8` on its command line), where a file setting one value twice is refused."""
    path = write_study(tmp_path, TINY_STUDY)
    done = sweep_cli("run", path, *[arg for item in items for arg in ("--set", item)])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: command line: {line}"]
    assert not (tmp_path / "tiny.db").exists()


def test_a_set_and_an_option_giving_one_value_are_refused_and_workers_get_the_option_alone(tmp_path: Path) -> None:
    """`--set n_trials=3 --n-trials 1`: the option silently won. Refused, naming both (diff review: "n_trials is
    set twice" named a --set given once). A `--workers` worker is given the budget and name as options, so a
    launcher's `--set n_trials=N` reaches it once."""
    path = write_study(tmp_path, TINY_STUDY)
    for items, option in ((["--set", "n_trials=3", "--n-trials", "1"], "--n-trials"),
                          (["--set", "n_trials=1", "--n-trials", "1"], "--n-trials"),
                          (["--study-name", "b", "--set", "name=a"], "--study-name"),
                          (["--set", "timeout=5", "--timeout", "600"], "--timeout"),  # review: the option won
                          (["--storage", f"sqlite:///{tmp_path / 'b.db'}", "--set",
                            f"storage=sqlite:///{tmp_path / 'a.db'}"], "--storage")):
        refused = sweep_cli("run", path, *items)
        key = {"--n-trials": "n_trials", "--study-name": "name"}.get(option, option.removeprefix("--"))
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            f"error: --set {key} and {option} both set {key}; keep one of them"], refused.stderr
    assert not [p.name for p in tmp_path.glob("*.db")]
    done = run_cli("run", path, "--workers", "2", "--set", "n_trials=2")
    assert done.returncode == 0, done.stderr
    assert sweep_cli("status", path).stdout.count("2/2 trials") == 1


def test_a_set_inside_a_value_an_earlier_set_gave_adjusts_it(tmp_path: Path) -> None:
    path = write_study(tmp_path, TINY_STUDY)
    spec, _ = load_spec(path, ["pruner=percentile", "pruner.percentile=40", "space.model.hidden={type: int, low: 8, "
                               "high: 16}", "space.model.hidden.log=true"])
    assert spec.pruner.type == "percentile" and spec.pruner.args.get("percentile") == 40
    assert (spec.space["model.hidden"].low, spec.space["model.hidden"].high, spec.space["model.hidden"].log) == (
        8, 16, True)


def test_yaml_exponents_without_a_dot_work_as_numbers(tmp_path: Path) -> None:
    path = write_study(tmp_path, TINY_STUDY)
    text = path.read_text().replace("low: 0.001", "low: 1e-3")
    path.write_text(text)
    spec, _ = load_spec(path)
    assert spec.space["learning_rate"].low == 1e-3


def test_a_searched_batch_size_whose_choices_split_evenly_is_taken_with_several_ranks(tmp_path: Path) -> None:
    """Only the searched choices are checked against devices_per_trial, not the default batch size (64)."""
    document = changed(resources={"devices_per_trial": 3}, fixed={"max_steps": 20},
                       space={"batch_size": {"type": "categorical", "choices": [48, 96]}})
    spec, _ = load_spec(write_study(tmp_path, document))
    assert spec.resources.devices_per_trial == 3


@pytest.mark.parametrize("document", [
    # Every width it draws (even numbers) divides by each head count it searches (1, 2), though not by the
    # task's default of 4 heads, which the study never uses.
    changed(task={"name": "charlm", "args": {"context": 16, "max_chars": 4000}}, space={
        "model.n_heads": {"type": "categorical", "choices": [1, 2]},
        "model.d_model": {"type": "int", "low": 64, "high": 128, "step": 2}}),
    # A range pinned to one value (--set space.batch_size.high=64) draws a multiple of the ranks only.
    changed(resources={"devices_per_trial": 2}, fixed__batch_size=...,
            space__batch_size={"type": "int", "low": 64, "high": 64}),
    changed(space__learning_rate={"type": "float", "low": 0.01, "high": 0.1, "step": 0.01},
            space__warmup_steps={"type": "int", "low": 0, "high": 10, "log": False}),
    # A score minimised on purpose: only the default direction is taken for a forgotten one.
    changed(metric="val_accuracy", direction="minimize", pruner="fastfail"),
])
def test_studies_whose_every_draw_trains_are_taken(tmp_path: Path, document: dict) -> None:
    load_spec(write_study(tmp_path, document))  # the checks of draws between the ends refuse none of these


def test_a_float_range_over_a_task_argument_annotated_int_is_refused_before_any_trial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`task_args.n_val: {type: float, low: 100, high: 300}` for `def picky(n_val: int = 300)`: its ends are whole
    numbers, so building the task with them passed, and every trial then failed on a drawn fraction."""
    (tmp_path / "picky_tasks.py").write_text(
        "import torch\nfrom torch import nn\nfrom trainer.tasks import Task\n\n"
        "def picky(n_val: int = 300, scale: float = 1.0):\n"
        "    x, y = torch.zeros(64, 2), torch.zeros(64, dtype=torch.long)\n"
        "    return Task(name='picky', train=(x, y), val=(x, y), build_model=lambda cfg: nn.Linear(2, 2))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    space = {"task_args.n_val": {"type": "float", "low": 100, "high": 300},
             "task_args.scale": {"type": "float", "low": 0.5, "high": 2}}  # a float for a float: fine
    path = write_study(tmp_path, changed(task="picky_tasks:picky", space=space))
    with pytest.raises(StudyFileError) as info:
        load_spec(path)
    assert info.value.problems == [("space.task_args.n_val.type", "task_args.n_val takes integers (the task's "
                                                                   "function says `int`); use type: int")]


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


@pytest.mark.skipif(_installed("google.cloud.storage"), reason="google-cloud-storage is installed here")
def test_an_object_store_whose_client_is_not_installed_is_refused_creating_nothing(tmp_path: Path) -> None:
    """`gs://` without google-cloud-storage: Optuna's artifact store raised its ImportError as a traceback when the
    first trial started, after the study was created."""
    path = write_study(tmp_path, changed(checkpoints={"store": "gs://bucket/prefix"}))
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {path}: checkpoints.store: gs:// needs google-cloud-storage, which is not installed: "
        "pip install 'sweep[gs]'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]


def test_an_override_reaches_into_a_pruner_or_sampler_named_by_a_word_or_left_at_its_default(tmp_path: Path) -> None:
    """`pruner: none` is `{type: none}`, so `--set pruner.type=median` overrides its type (it was refused: "pruner
    is 'none', not a mapping"); with no `pruner:` in the file, `--set pruner.then.n_startup_trials=3` goes into the
    default fastfail-then-median (it replaced the default, and the file was blamed for a missing type)."""
    path = write_study(tmp_path, changed(pruner="none", sampler="tpe"))
    spec, _ = load_spec(path, ["pruner.type=median", "sampler.n_startup_trials=3"])
    assert spec.pruner.type == "median" and spec.sampler.type == "tpe"
    assert spec.sampler.args == {"n_startup_trials": 3}
    path = write_study(tmp_path, changed(pruner=...))
    spec, _ = load_spec(path, ["pruner.then.n_startup_trials=3"])
    assert spec.pruner.type == "fastfail" and spec.pruner.args["then"] == {"type": "median", "n_startup_trials": 3}


@pytest.mark.parametrize(("name", "kind"), [
    ("val_loss", "loss"), ("loss/val", "loss"), ("val_nll", "loss"), ("perplexity", "loss"), ("val_error", "loss"),
    ("val_accuracy", "score"), ("val/acc", "score"), ("eval-accuracy", "score"), ("mean_accuracy", "score"),
    ("accuracy_top1", "score"), ("f1_macro", "score"), ("map50", "score"), ("episode_reward_mean", "score"),
    ("ndcg@10", "score"),
    ("val_top_1_acc", "score"), ("top_5", "score"), ("total_loss", "loss"),
    ("neg_loss", None), ("top1_error", None), ("samples_per_s", None), ("wall_time", None), ("lossless_bits", None),
    # words that are no qualifier make the name say nothing (diff review: `loss_reduction` maximised was refused)
    ("loss_reduction", None), ("nll_improvement", None), ("time_to_accuracy", None), ("acc_gap", None),
    ("reward_std", None), ("1-accuracy", None), ("1_auc", None),  # one minus a score (second diff review)
])
def test_a_metric_s_direction_is_read_from_the_words_of_its_name(name: str, kind: str | None) -> None:
    """Found by review: only `val_loss`-like names (a prefix, an underscore, the word) were read, so `mean_accuracy`
    (Ray Tune's), `val/acc` (W&B's and Lightning's) ran minimised and `loss/val` maximised, without a word."""
    from sweep.spec import _metric_kind

    assert _metric_kind(name) == kind


def test_a_search_range_under_a_loop_s_fixed_is_warned_of_not_refused() -> None:
    """Found by review: a loop study's trials got a range written under `fixed:` as the mapping itself, without a
    word. It may be the loop's own (a range it samples from itself, found by the diff review), so it is said, once,
    and the study runs."""
    from sweep.spec import RangeInFixed

    study = Path(__file__).parents[2] / "studies" / "loop.yaml"
    with pytest.warns(RangeInFixed, match=r"fixed\.augment\.scale: a search range \(type: float\) under fixed:.* "
                                          r"move it under space: as augment\.scale"):
        spec, _ = load_spec(study, ["fixed.augment={scale: {type: float, low: 0.8, high: 1.2}}"])
    assert spec.fixed["augment"] == {"scale": {"type": "float", "low": 0.8, "high": 1.2}}


def test_did_you_mean_suggests_another_tool_s_word_and_no_key_a_short_word_begins() -> None:
    from sweep.schema import did_you_mean

    assert did_you_mean("num_samples", ["n_trials", "seed"]) == " (did you mean 'n_trials'?)"
    assert did_you_mean("max", ["low", "high"]) == " (did you mean 'high'?)"
    assert did_you_mean("max", ["minimize", "maximize"]) == " (did you mean 'maximize'?)"
    assert did_you_mean("CmaEsSampler", ["tpe", "cmaes"]) == " (did you mean 'cmaes'?)"
    assert did_you_mean("n_startup", ["n_startup_trials", "seed"]) == " (did you mean 'n_startup_trials'?)"
    assert did_you_mean("data", ["data_loader", "seed"]) == ""  # a data path is no loader (diff review)
    assert did_you_mean("warmup", ["warmup_steps", "seed"]) == " (did you mean 'warmup_steps'?)"
    assert did_you_mean("reduction", ["reduction_factor"]) == " (did you mean 'reduction_factor'?)"



@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.complex64])
def test_validation_data_of_any_floating_dtype_is_checked_for_nan(dtype: torch.dtype) -> None:
    """Diff review: float8 validation data made the check itself raise (no `isfinite` for it); each floating dtype is
    read as float32 (complex as it is)."""
    from sweep.spec import _unfinite_validation
    from trainer.tasks import Task

    inputs = torch.zeros(6, 2).to(dtype)
    inputs[4, 1] = float("nan")
    task = Task(name="odd", train=(torch.zeros(6, 2), torch.zeros(6, dtype=torch.long)),
                val=(inputs, torch.zeros(6, dtype=torch.long)), build_model=lambda cfg: torch.nn.Linear(2, 2))
    said = _unfinite_validation(task)
    assert said is not None and said.startswith("task 'odd': its validation inputs hold NaN or infinity (sample 4)")
    clean = Task(name="odd", train=task.train, val=(torch.zeros(6, 2).to(dtype), task.val[1]),
                 build_model=task.build_model)
    assert _unfinite_validation(clean) is None
    huge = torch.zeros(6, 2, dtype=torch.float64)
    huge[3, 0] = 1e300  # finite, past float32's range (second diff review: taken for infinity)
    assert _unfinite_validation(Task(name="odd", train=task.train, val=(huge, task.val[1]),
                                     build_model=task.build_model)) is None


def test_a_required_task_argument_given_only_by_the_search_is_accepted(tmp_path: Path) -> None:
    """Tasks review: searching `task_args.classes` of `arrays` (a required argument) with no value in `task.args`
    was refused: "arrays() missing 1 required positional argument: 'classes'", though each end of the range builds
    the task below; a placeholder value in `task.args` made the same search pass."""
    name = f"needs_arg_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        "from trainer.tasks.digits import digits\n\n"
        "def task(width, kind):\n"
        "    assert width in (1, 2, 3) and kind in ('a', 'b'), (width, kind)\n"
        "    return digits()\n")
    path = write_study(tmp_path, changed(task=f"{name}:task", space={
        "learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True},
        "task_args.width": {"type": "int", "low": 1, "high": 3},
        "task_args.kind": {"type": "categorical", "choices": ["a", "b"]}}))
    spec, _ = load_spec(path)
    assert set(spec.space) == {"learning_rate", "task_args.width", "task_args.kind"}
