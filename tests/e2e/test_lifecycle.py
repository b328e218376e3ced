"""The trial lifecycle through the real CLI and a real SQLite file: `--timeout` within one evaluation interval, and a
retry that continues its lineage (one continuous curve, bit for bit the uninterrupted run's)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import threading
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from sweep.outcomes import budget_counts
from tests.conftest import TINY_STUDY, run_cli, sweep_cli, write_study

MAX_STEPS, EVERY = 6000, 500


def one_config_study(folder: Path, name: str) -> Path:
    """One trial of a fixed config, long enough to outlast a 2 s timeout on any machine: 6000 steps, a log, an
    evaluation and a checkpoint every 500, fast-fail on (so step 0 is reported too)."""
    document = copy.deepcopy(TINY_STUDY) | {"name": name, "n_trials": 1, "pruner": {"type": "fastfail"},
                                            "checkpoints": {"every_steps": EVERY, "keep_top_k": 1}}
    document["fixed"] = {**document["fixed"], "max_steps": MAX_STEPS, "eval_every_steps": EVERY,
                         "log_every_steps": EVERY, "learning_rate": 0.01, "model": {"hidden": 16}}
    document["space"] = {}
    folder.mkdir()
    return write_study(folder, document)


def trials(path: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{path.parent / (name + '.db')}").get_trials()


def test_a_timeout_stops_the_trial_at_its_next_evaluation_and_its_retry_continues_the_curve(tmp_path: Path) -> None:
    path = one_config_study(tmp_path / "cut", "cut")
    done = sweep_cli("run", path, "--timeout", "2")
    assert done.returncode == 0, done.stderr
    assert "stopped by the timeout" in done.stderr
    assert "trial 0: interrupted: --timeout of 2 s\n" in done.stderr, done.stderr  # its line, as any ended trial's
    [cut, queued] = trials(path, "cut")
    assert cut.state == TrialState.FAIL and cut.user_attrs["outcome"] == "interrupted"
    assert cut.user_attrs["fail_reason"].startswith("interrupted: --timeout")
    stopped_at = max(cut.intermediate_values)
    assert 0 < stopped_at < MAX_STEPS  # at an evaluation after the timeout, with a checkpoint there, not at the end
    assert queued.state == TrialState.WAITING and queued.user_attrs["retry_of"] == cut.number

    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    retry = trials(path, "cut")[1]
    assert retry.state == TrialState.COMPLETE
    assert retry.user_attrs["resumed_from"] == {"trial": cut.number, "step": stopped_at}
    assert retry.user_attrs["steps_trained"] == MAX_STEPS - stopped_at
    # The interrupted trial's steps count too (they counted 0: it ended before recording them; found by review).
    status = sweep_cli("status", path)
    assert f"{MAX_STEPS} steps trained" in status.stdout, status.stdout
    listed = json.loads(sweep_cli("trials", path, "--format", "json").stdout)  # as far as it came, not blank
    assert [row["steps"] for row in listed] == [stopped_at, MAX_STEPS]

    reference = one_config_study(tmp_path / "whole", "whole")
    assert sweep_cli("run", reference).returncode == 0
    [whole] = trials(reference, "whole")
    assert sorted(retry.intermediate_values) == list(range(0, MAX_STEPS + 1, EVERY))  # one curve, from step 0
    assert retry.intermediate_values == whole.intermediate_values  # bit for bit, as if never interrupted
    assert retry.value == whole.value
    assert sweep_cli("reproduce", path, str(retry.number)).returncode == 0


def test_a_store_folder_gone_at_a_rerun_stops_it_and_keeps_the_resume_points_for_when_it_is_back(
        tmp_path: Path) -> None:
    """A store on a share not mounted when the study was rerun: every checkpoint row looked missing and was
    forgotten, so once the share was back the retry trained from its first step (and `sweep check` called the
    intact files orphans). Now the rerun stops at once with one line and keeps the rows."""
    path = one_config_study(tmp_path / "cut", "cut")
    assert sweep_cli("run", path, "--timeout", "2").returncode == 0
    cut = trials(path, "cut")[0]
    stopped_at = max(cut.intermediate_values)
    store = path.parent / "cut.checkpoints" / "cut"
    store.rename(path.parent / "unmounted")
    done = sweep_cli("run", path)
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {path}: checkpoints.store: the study's folder {store} is not there, and the "
                           "registry names "), done.stderr
    assert line.endswith(" checkpoints in it that trials resume, warm-start or are reproduced from: mount or "
                         "restore it, then rerun; its rows are kept. If its checkpoints are gone for good, "
                         f"`sweep check {path} --repair` forgets them"), done.stderr
    assert not store.exists()  # not made anew, empty, by the run's claim of it
    assert [t.state for t in trials(path, "cut")] == [TrialState.FAIL, TrialState.WAITING]  # nothing trained
    (path.parent / "unmounted").rename(store)
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    retry = trials(path, "cut")[1]
    assert retry.state == TrialState.COMPLETE
    assert retry.user_attrs["resumed_from"] == {"trial": cut.number, "step": stopped_at}
    # Its checkpoints deleted on purpose: the retry's resume point (pinned, for `sweep reproduce`) stops the run
    # until `sweep check --repair`, as the line says, forgets it; then the study goes on.
    shutil.rmtree(store)
    done = sweep_cli("run", path, "--n-trials", "2")
    assert done.returncode == 1 and "registry names 1 checkpoints in it" in done.stderr, done.stderr
    assert sweep_cli("check", path, "--repair").returncode == 0
    done = sweep_cli("run", path, "--n-trials", "2")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("how", [["--cohort", "2"], ["--workers", "2"], ["--workers", "2", "--file-timeout"]],
                         ids=["cohort", "workers", "workers-file-timeout"])
def test_a_timeout_that_stops_every_trial_of_a_run_is_no_failed_run(tmp_path: Path, how: list[str]) -> None:
    """Interrupted trials are not failures: a cohort's members, or several workers' trials, all stopped by --timeout
    made the run exit 1 with "every trial of this run failed", where one trial at a time exits 0."""
    path = one_config_study(tmp_path / "cut", "cut")
    # The study file's timeout: a launcher of --workers that looked at --timeout alone said "the sampler has tried
    # every point of the search space" (review).
    document = yaml.safe_load(path.read_text()) | {"n_trials": 2} | ({"timeout": 2} if "--file-timeout" in how else {})
    path.write_text(yaml.safe_dump(document))
    limit = [] if "--file-timeout" in how else ["--timeout", "2"]
    how = [flag for flag in how if flag != "--file-timeout"]
    done = sweep_cli("run", path, *limit, *how) if how[0] == "--cohort" else run_cli("run", path, *limit, *how)
    assert done.returncode == 0, done.stderr
    assert "every trial of this run failed" not in done.stderr
    # The launcher of --workers said nothing of the timeout, where one process says it (review).
    assert "stopped by the timeout with 0/2 trials done; rerun to continue." in done.stderr, done.stderr
    ended = [t for t in trials(path, "cut") if t.state == TrialState.FAIL]
    assert ended and all(t.user_attrs["outcome"] == "interrupted" for t in ended)


def test_a_sampler_that_raises_for_one_trial_fails_that_trial_alone(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A trial's params are drawn when it is asked, under the study's lock. A sampler error there (a broken optional
    # dependency, a GP fit that fails, a user's sampler) once took the worker down with a traceback and left the
    # trial running; it fails that trial alone, with its message, as an error of the trial's start does.
    original = optuna.samplers.RandomSampler.sample_independent

    def flaky(self: optuna.samplers.RandomSampler, study: optuna.Study, trial: optuna.trial.FrozenTrial,
              name: str, distribution: optuna.distributions.BaseDistribution) -> object:
        if trial.number == 1:
            raise RuntimeError("my sampler broke on trial 1")
        return original(self, study, trial, name, distribution)

    monkeypatch.setattr(optuna.samplers.RandomSampler, "sample_independent", flaky)
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY))
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    found = trials(path, "tiny")
    assert [t.state for t in found] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert found[1].user_attrs["fail_reason"] == "RuntimeError: my sampler broke on trial 1"


def searched_study(folder: Path, name: str) -> Path:
    """`one_config_study` with the learning rate searched (so a retry's params are its own to keep), and heartbeats
    that declare a silent trial lost within seconds."""
    document = yaml.safe_load(one_config_study(folder, name).read_text())
    document["fixed"].pop("learning_rate")
    document["space"] = {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}}
    document |= {"heartbeat_interval": 1, "heartbeat_grace_period": 2}
    return write_study(folder, document)


def taken_and_killed(path: Path, name: str, number: int) -> None:
    """What a worker killed right after `ask` took a queued trial, before it wrote its params, leaves: the trial
    RUNNING with no params and no heartbeat, its params only in the queue's `fixed_params`."""
    storage = optuna.storages.RDBStorage(f"sqlite:///{path.parent / (name + '.db')}")
    trial = next(t for t in trials(path, name) if t.number == number)
    assert trial.state == TrialState.WAITING and not trial.params
    assert storage.set_trial_state_values(trial._trial_id, TrialState.RUNNING)
    storage.engine.dispose()


def test_a_queued_retry_killed_before_it_wrote_its_params_is_retried_with_its_lineage_s_params(
        tmp_path: Path) -> None:
    # Its retry was queued with no params: it drew new ones and resumed the lineage's checkpoints, trained with the
    # old (a wrong value, which `sweep reproduce` refused; with a searched width, a state that did not load).
    path = searched_study(tmp_path / "lost", "lost")
    done = sweep_cli("run", path, "--timeout", "2")
    assert done.returncode == 0, done.stderr
    [cut, queued] = trials(path, "lost")
    stopped_at = max(cut.intermediate_values)
    taken_and_killed(path, "lost", queued.number)

    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    lost, retry = trials(path, "lost")[1:]
    assert lost.user_attrs["outcome"] == "lost" and retry.user_attrs["retry_of"] == lost.number
    assert retry.params == cut.params
    assert retry.state == TrialState.COMPLETE
    assert retry.user_attrs["resumed_from"] == {"trial": cut.number, "step": stopped_at}


def test_a_trial_lost_while_it_was_asked_is_retried_without_a_word_about_checkpoints_it_never_had(
        tmp_path: Path) -> None:
    # Found by fault injection: a worker stopped in an outage while it wrote a new trial's params left the trial with
    # one of two; its retry kept that one, drew the other, and warned that it did not resume from the lost trial's
    # checkpoints "trained with other params", where there were none.
    path = searched_study(tmp_path / "asked", "asked")
    document = yaml.safe_load(path.read_text())
    document["space"]["weight_decay"] = {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}
    document["fixed"]["max_steps"] = 20
    write_study(path.parent, document)
    assert sweep_cli("run", path).returncode == 0
    study = optuna.load_study(study_name="asked", storage=f"sqlite:///{path.parent / 'asked.db'}")
    half = study.ask()  # RUNNING, no heartbeat, one param of two: as a worker stopped between them leaves it
    learning_rate = half.suggest_float("learning_rate", 1e-3, 1e-1, log=True)

    done = sweep_cli("run", path, "--n-trials", "2")
    assert done.returncode == 0, done.stderr
    retry = trials(path, "asked")[-1]
    assert retry.user_attrs["retry_of"] == half.number and retry.state == TrialState.COMPLETE
    assert retry.params["learning_rate"] == learning_rate and "weight_decay" in retry.params
    assert "does not resume" not in done.stderr, done.stderr


def test_a_retry_whose_params_are_not_its_lineage_s_trains_from_scratch_saying_why(tmp_path: Path) -> None:
    # The last guard: checkpoints trained with other params never hand their state to a trial.
    path = searched_study(tmp_path / "other", "other")
    assert sweep_cli("run", path, "--timeout", "2").returncode == 0
    [cut, queued] = trials(path, "other")
    storage = optuna.storages.RDBStorage(f"sqlite:///{path.parent / 'other.db'}")
    other = {"learning_rate": cut.params["learning_rate"] / 2}
    storage.set_trial_system_attr(queued._trial_id, "fixed_params", other)
    storage.engine.dispose()

    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    retry = trials(path, "other")[1]
    assert retry.params == other and "resumed_from" not in retry.user_attrs
    assert min(retry.intermediate_values) == 0  # trained from step 0
    assert f"trial {retry.number} does not resume from trial {cut.number}'s checkpoints: they were trained with " \
           "other params" in done.stderr


def test_a_trial_another_tool_failed_in_the_study_counts_as_failed_and_is_neither_lost_nor_retried(
        tmp_path: Path) -> None:
    # Found by review: plain Optuna's `optimize(catch=...)` in a sweep study left failed trials without sweep's
    # reason; the next `sweep run` called them lost, wrote "worker lost" over them and trained their params again,
    # beyond the budget.
    document = copy.deepcopy(TINY_STUDY) | {"name": "mixed", "n_trials": 2, "heartbeat_interval": 1,
                                            "heartbeat_grace_period": 2}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    study = optuna.load_study(study_name="mixed", storage=f"sqlite:///{tmp_path / 'mixed.db'}")

    def broken(trial: optuna.Trial) -> float:
        trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
        raise ValueError("my objective broke")

    study.optimize(broken, n_trials=1, catch=(ValueError,))
    time.sleep(2.5)  # past the grace period: a trial of sweep's ended so long ago without its retry would get one
    done = sweep_cli("run", path, "--n-trials", "4")
    assert done.returncode == 0, done.stderr
    everything = trials(path, "mixed")
    assert len(everything) == 4 and "retry_of" not in everything[3].user_attrs  # one new trial: 4 in all
    assert everything[2].state == TrialState.FAIL and everything[2].user_attrs == {}  # left as the other tool wrote it
    assert budget_counts(everything) == (4, 0)
    listed = sweep_cli("trials", path, "--format", "json")
    assert [row["outcome"] for row in json.loads(listed.stdout)][2] == "failed", listed.stdout


def test_a_trial_failed_from_outside_while_it_trains_stays_failed_and_is_not_retried(tmp_path: Path) -> None:
    """Found by review: a trial a person failed while it trained (optuna-dashboard's buttons, `Study.tell`) was taken
    for lost: "worker lost: no heartbeat" was written over it, and after a grace period its config trained again.
    Now its worker stops it, says so, and stores it as failed from outside, never retried."""
    document = copy.deepcopy(TINY_STUDY) | {"name": "told", "n_trials": 1, "heartbeat_interval": 1,
                                            "heartbeat_grace_period": 2}
    document["fixed"] = {**document["fixed"], "max_steps": 100_000, "eval_every_steps": 10}
    path = write_study(tmp_path, document)
    told: list[int] = []

    def tell_fail_once_it_reports() -> None:
        storage = f"sqlite:///{tmp_path / 'told.db'}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if not (tmp_path / "told.db").exists():  # Optuna's storage would make the file, racing the run's making
                time.sleep(0.05)
                continue
            try:
                study = optuna.load_study(study_name="told", storage=storage)
                running = [t for t in study.get_trials() if t.state == TrialState.RUNNING and t.intermediate_values]
            except Exception:  # noqa: BLE001 - not created yet (KeyError), or the database busy: look again
                running = []
            if running:
                try:
                    study.tell(running[0].number, state=TrialState.FAIL)
                except Exception:  # noqa: BLE001 - the database busy: tell it again
                    time.sleep(0.05)
                    continue
                told.append(running[0].number)
                return
            time.sleep(0.05)

    teller = threading.Thread(target=tell_fail_once_it_reports)
    teller.start()
    done = sweep_cli("run", path)
    teller.join()
    assert told == [0], done.stderr
    assert done.returncode == 0, done.stderr  # the study's one trial ended as a person decided: no failed run
    assert "trial 0 was told FAIL from outside (optuna-dashboard, Study.tell) while this worker trained it; not " \
           "retried" in done.stderr, done.stderr
    assert "declared lost" not in done.stderr and "no heartbeat" not in done.stderr, done.stderr
    time.sleep(2.5)  # past the 2 s grace period (not a wait for work): a trial taken for lost is retried by a run now
    again = sweep_cli("run", path)
    assert again.returncode == 0, again.stderr
    [trial] = trials(path, "told")  # no retry: the budget of one is spent by the trial the person failed
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["outcome"] == "failed", trial.user_attrs
    assert trial.user_attrs["fail_reason"] == ("told FAIL from outside (optuna-dashboard, Study.tell) while it "
                                               "trained"), trial.user_attrs
    listed = sweep_cli("trials", path, "--format", "csv")  # the outcome once, then the reason
    assert "failed: told FAIL from outside" in listed.stdout and "failed: failed:" not in listed.stdout, listed.stdout


def test_a_trial_added_from_outside_is_never_the_best_sweep_writes(tmp_path: Path) -> None:
    """Found by review: a baseline added with `Study.add_trial` (no config, a better value) became the study's best,
    and `sweep best` refused the study (exit 2: "holds no recorded config"). The best is the best trial sweep ran,
    and `sweep best` says which better trial it passed over."""
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"name": "based", "n_trials": 2})
    assert sweep_cli("run", path).returncode == 0
    ran = trials(path, "based")
    ours = min(ran, key=lambda t: t.value)
    study = optuna.load_study(study_name="based", storage=f"sqlite:///{tmp_path / 'based.db'}")
    study.add_trial(optuna.trial.create_trial(
        params={"learning_rate": 0.01}, value=1e-9,
        distributions={"learning_rate": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}))
    done = sweep_cli("best", path, "-o", tmp_path / "best.yaml")
    assert done.returncode == 0, done.stderr
    assert "note: trial 2's value 1e-09 is better, but it was added to the study from outside" in done.stderr
    assert f"trial {ours.number} is the best trial sweep ran" in done.stderr, done.stderr
    written = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert written["learning_rate"] == ours.params["learning_rate"]
    status = sweep_cli("status", path)
    assert f"#{ours.number}" in status.stdout and "1e-09" not in status.stdout, status.stdout
    assert sweep_cli("report", path, "-o", tmp_path / "r.html").returncode == 0  # its best-so-far line passes it over
    page = (tmp_path / "r.html").read_text()
    line = re.search(r'"name":"Best Value","x":\[[^\]]*\],"y":(\[[^\]]*\])', page)
    assert line is not None and json.loads(line.group(1))[-1] == ours.value, line


def test_a_queued_trial_whose_params_name_a_key_the_study_does_not_search_is_warned_of(tmp_path: Path) -> None:
    """Found by review: `study.enqueue_trial({"learnin_rate": ...})`, a typo, trained a sampled learning rate
    without a word (Optuna ignores a queued param no suggest asks for)."""
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"name": "queued", "n_trials": 1})
    assert sweep_cli("run", path).returncode == 0
    study = optuna.load_study(study_name="queued", storage=f"sqlite:///{tmp_path / 'queued.db'}")
    study.enqueue_trial({"learnin_rate": 0.5, "model.hidden": 9})
    done = sweep_cli("run", path, "--n-trials", "2")
    assert done.returncode == 0, done.stderr
    assert ("warning: trial 1 was queued with 'learnin_rate', which this study does not search (it searches "
            "'learning_rate', 'model.hidden'): ignored, and the searched keys it did not give are sampled"
            ) in done.stderr, done.stderr
    queued = trials(path, "queued")[1]
    assert queued.params["model.hidden"] == 9 and queued.params["learning_rate"] != 0.5  # the rest as queued
