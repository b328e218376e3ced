"""`sweep submit` without a cluster: the batch script of --dry-run, the Kubernetes manifest, and bad launch options
(exit 2, one line naming where, nothing created). The real cluster runs in tests/e2e/test_slurm.py."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sweep.workers import STORAGE_FILE_ENV, storage_from_environment, write_storage_file
from tests.conftest import ROOT, changed, sweep_cli, write_study

PASSWORD = "s3cret-pw"
URL = f"postgresql+psycopg://sweeper:{PASSWORD}@db.example/sweeps"

# Every Slurm option, from the command line, with the #SBATCH line it must become.
OPTIONS = {"--workers": ("3", "--array=0-2"), "--partition": ("gpu", "--partition=gpu"),
           "--time": ("4:00:00", "--time=4:00:00"), "--account": ("lab", "--account=lab"),
           "--qos": ("normal", "--qos=normal"), "--mem": ("16G", "--mem=16G"),
           "--cpus-per-task": ("4", "--cpus-per-task=4"), "--gpus-per-task": ("2", "--gres=gpu:2"),
           "--warning-s": ("300", "--signal=B:USR1@300"), "--sbatch": ("--constraint=a100", "--constraint=a100")}


def created(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


def test_dry_run_prints_a_plain_script_naming_every_option_and_creates_nothing(tmp_path: Path) -> None:
    path = write_study(tmp_path, document := changed(storage=URL))
    before = created(tmp_path)
    args = ["submit", path, "--slurm", "--dry-run", *(item for flag, (value, _) in OPTIONS.items()
                                                       for item in (flag, value))]
    first, again = sweep_cli(*args, cwd=tmp_path), sweep_cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout  # stable: no date, nothing random
    assert created(tmp_path) == before  # no study, no job folder, no storage file
    script = first.stdout
    directives = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    for flag, (_, line) in OPTIONS.items():
        assert line in directives, flag
    assert {"--requeue", "--open-mode=append", f'--output="{tmp_path}/tiny.slurm/%A_%a.log"'} <= set(directives)
    assert PASSWORD not in script and "db.example" not in script  # the URL is in the storage file, not here
    assert re.search(rf"^export {STORAGE_FILE_ENV}={tmp_path}/tiny.slurm/storage-[0-9a-f]{{12}}\.json$", script, re.M)
    # The worker: the ordinary `sweep run` of this study, with its name and budget, two workers for two GPUs.
    assert f"-m sweep run {path} --study-name tiny --n-trials {document['n_trials']} --workers 2 &" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell


def test_the_study_files_launch_section_is_used_and_the_command_line_wins(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed(launch={"slurm": {"partition": "cpu", "time": "30", "workers": 5,
                                                            "sbatch": ["#SBATCH --exclusive"], "log_dir": "logs"}}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", "--partition", "gpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "#SBATCH --partition=gpu" in lines and "#SBATCH --partition=cpu" not in lines
    assert {"#SBATCH --time=30", "#SBATCH --array=0-4", "#SBATCH --exclusive",
            f'#SBATCH --output="{tmp_path}/logs/%A_%a.log"'} <= set(lines)


def test_studies_sharing_a_log_dir_and_one_study_on_two_storages_each_name_their_own_storage_file(
        tmp_path: Path) -> None:
    # Review: one `storage.json` per job folder. Two studies given the same `launch.slurm.log_dir` (or one study
    # submitted to two storages) wrote the same file, and the earlier job's tasks read the later submit's URL: they
    # created their study anew in the other database, trained it there, and left their own at 0 trials.
    def storage_file(name: str, url: str) -> str:
        path = write_study(tmp_path, changed(name=name, storage=url, launch={"slurm": {"log_dir": "logs"}}),
                           f"{name}.yaml")
        done = sweep_cli("submit", path, "--slurm", "--dry-run", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        (line,) = [line for line in done.stdout.splitlines() if line.startswith(f"export {STORAGE_FILE_ENV}=")]
        assert line.startswith(f"export {STORAGE_FILE_ENV}={tmp_path}/logs/storage-")
        return line

    alpha, beta = storage_file("alpha", URL), storage_file("beta", URL)
    elsewhere = storage_file("alpha", URL.replace("db.example", "db2.example"))
    assert len({alpha, beta, elsewhere}) == 3
    assert storage_file("alpha", URL.replace(PASSWORD, "another-pw")) == alpha  # the same database: the same file
    assert PASSWORD not in alpha


def test_a_study_folder_with_a_newline_in_its_path_gets_no_batch_script(tmp_path: Path) -> None:
    # The folder's path goes into the script's comment and --output lines: a newline in it ended the line, and what
    # followed ran as a command (and, not a comment, made sbatch ignore every #SBATCH line after it).
    folder = tmp_path / "runs\ntouch pwned #"
    folder.mkdir()
    path = write_study(folder, changed(storage=URL, checkpoints={"store": str(tmp_path / "store")}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds a control character, which the batch script cannot hold safely" in lines[0], \
        lines


def test_a_slurm_time_given_as_a_whole_number_is_sbatch_s_minutes(tmp_path: Path) -> None:
    # `time: 60` was refused as "Input should be a valid string", while the message for a bad time suggests "90".
    path = write_study(tmp_path, changed(launch={"slurm": {"time": 60}}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --time=60" in done.stdout.splitlines()
    refused = sweep_cli("submit", write_study(tmp_path, changed(launch={"slurm": {"time": True}}), "b.yaml"),
                        "--slurm", "--dry-run", cwd=tmp_path)
    assert refused.returncode == 2 and "launch.slurm.time" in refused.stderr  # a boolean is no number of minutes


def test_a_sqlite_storage_is_submitted_with_a_warning(tmp_path: Path) -> None:
    done = sweep_cli("submit", write_study(tmp_path, changed()), "--slurm", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0
    assert "warning: SQLite storage" in done.stderr and "every node must see this file" in done.stderr


@pytest.mark.parametrize(("document", "args", "expected"), [
    (changed(launch={"slurm": {"time": "1h"}}), [], "study.yaml: launch.slurm.time: expected a Slurm time"),
    (changed(launch={"slurm": {"partiton": "gpu"}}), [], "launch.slurm.partiton: unknown key (did you mean "
                                                         "'partition'?)"),
    (changed(launch={"slurm": {"workers": 0}}), [], "launch.slurm.workers: Input should be greater than or equal"),
    (changed(launch={"slurm": {"sbatch": ["--x\n#SBATCH --y"]}}), [], "launch.slurm.sbatch[0]: expected one sbatch"),
    (changed(launch={"slurm": {"mem": 16}}), [], "launch.slurm.mem: Input should be a valid string"),
    # A bare '16' is 16 MB to Slurm; other scripts' digits ('١٦G', '٩٠') reached the script (review).
    (changed(launch={"slurm": {"mem": "16"}}), [], "launch.slurm.mem: expected a Slurm memory size with its unit"),
    (changed(launch={"slurm": {"mem": "\u0661\u0666G"}}), [], "launch.slurm.mem: expected a Slurm memory size"),
    (changed(launch={"slurm": {"time": "\u0669\u0660"}}), [], "launch.slurm.time: expected a Slurm time"),
    (changed(), ["--mem", "16"], "command line: --mem: expected a Slurm memory size with its unit"),
    (changed(launch={"slurm": {"log_dir": ""}}), [], "launch.slurm.log_dir: expected a folder, got ''"),
    (changed(launch={"cloud": {}}), [], "launch.cloud: unknown key"),
    (changed(), ["--partition", "a b"], "command line: --partition: expected a Slurm name"),
    (changed(), ["--sbatch", "--x\nrm -rf /"], "command line: --sbatch: expected one sbatch option"),
    (changed(), ["--sbatch", "echo hi"], "command line: --sbatch: expected one sbatch option"),
    (changed(), ["--workers", "0"], "command line: --workers: Input should be greater than or equal to 1"),
    (changed(), ["--time", "1:00:00:00:00"], "command line: --time: expected a Slurm time"),
    # Beyond what Slurm keeps (32-bit minutes): `time: 1e308` was 309 digits in the script (review).
    (changed(launch={"slurm": {"time": 10**30}}), [], "launch.slurm.time: expected a Slurm time"),
    (changed(), ["--time", "1000000-00:00:00"], "command line: --time: expected a Slurm time"),
    (changed(), ["--cpus-per-task", "0"], "command line: --cpus-per-task: Input should be greater"),
    (changed(), ["--n-trials", "0"], "--n-trials: expected at least 1 trial"),
    # Numbers beyond what Slurm takes went into the script (`--array=0-99999999999999999999998`), exit 0.
    (changed(), ["--workers", "9" * 23], "command line: --workers: Input should be less than or equal to 4000000"),
    (changed(), ["--warning-s", "9" * 23], "command line: --warning-s: Input should be less than or equal to 65535"),
    (changed(launch={"slurm": {"warning_s": 70000}}), [], "launch.slurm.warning_s: Input should be less than or "
                                                          "equal to 65535"),
    # An option the batch script sets itself, given again: the later line won in silence, and `sweep status` and
    # `sweep stop` counted other tasks, read other logs, or the tasks were no longer requeued.
    (changed(launch={"slurm": {"sbatch": ["--array=0-9"]}}), [], "launch.slurm.sbatch[0]: expected an option the "
                                                                 "batch script does not set itself, got --array, "),
    (changed(), ["--sbatch", "-o /tmp/x.log"], "command line: --sbatch: expected an option the batch script does not "
                                               "set itself, got -o (--output), which sweep sets"),
    (changed(), ["--sbatch", "--out=x"], "got --out (--output), which sweep sets"),  # sbatch takes abbreviations
    (changed(), ["--sbatch", "--no-requeue"], "got --no-requeue, which sweep sets"),
    # Options after which the submit reported a job that does not run the study's workers (review: --test-only
    # submitted nothing, and the study recorded an empty job id).
    (changed(), ["--sbatch", "--test-only"], "got --test-only, which sweep sets: the job array is submitted"),
    (changed(), ["--sbatch", "--wrap=hostname"], "got --wrap, which sweep sets: the job runs the batch script"),
    (changed(), ["--sbatch", "-W"], "got -W (--wait), which sweep sets"),
    (changed(), ["--sbatch", "--export=NONE"], "got --export, which sweep sets"),
    (changed(), ["--sbatch", "--signal=B:USR2@60"], "got --signal, which sweep sets: the warning before the time "
                                                    "limit: launch.slurm.warning_s (--warning-s)"),
    (changed(), ["--sbatch", "#SBATCH -t 10"], "got -t (--time), which sweep sets: launch.slurm.time (--time)"),
    (changed(), ["--sbatch", "--gres=gpu:2"], "got --gres, which sweep sets: launch.slurm.gpus_per_task"),
    (changed(), ["--sbatch", "--gres=tmpfs:1,gpu:a100:2"], "got --gres, which sweep sets"),
    # Quoted, which sbatch takes without its quotes, and Slurm's other ways to ask for GPUs got past (review).
    (changed(), ["--sbatch", '--gres="gpu:2"'], "got --gres, which sweep sets"),
    (changed(), ["--sbatch", "--gres='gpu:a100:2'"], "got --gres, which sweep sets"),
    (changed(), ["--sbatch", "--gpus-per-socket=2"], "got --gpus-per-socket, which sweep sets"),
    (changed(), ["--sbatch", "--tres-per-task=gres/gpu:2"], "got --tres-per-task, which sweep sets"),
    # Short flags without an argument, then one sweep sets: sbatch reads `-Ho x` as `-H -o x`.
    (changed(), ["--sbatch", "-Ho x.log"], "got -Ho (--output), which sweep sets"),
    (changed(), ["--sbatch", "-vQe x.log"], "got -vQe (--error), which sweep sets"),
    # A time limit no longer than the warning: each task was warned as it started and requeued itself forever.
    (changed(launch={"slurm": {"time": 1}}), [], "launch.slurm.warning_s: expected fewer seconds than the time limit "
                                                 "launch.slurm.time 1 (60 s), got 120"),
    (changed(), ["--time", "2"], "command line: warning_s (the study file's, or its default): expected fewer "
                                 "seconds than the time limit launch.slurm.time 2 (120 s), got 120"),
    (changed(launch={"slurm": {"warning_s": 30}}), ["--time", "0:20"], "command line: warning_s (the study file's, "
                                                                       "or its default): expected fewer seconds "
                                                                       "than the time limit launch.slurm.time 0:20 "
                                                                       "(20 s), got 30"),
    (changed(launch={"slurm": {"time": "0:40", "warning_s": 10}}), ["--warning-s", "40"], "command line: "
                                                                                          "--warning-s: expected fewer "
                                                                         "seconds than the time limit"),
    (changed(launch={"slurm": {"time": "1-00"}}), ["--warning-s", "86400"], "command line: --warning-s: Input "
                                                                            "should be less than or equal to 65535"),
    # A log folder whose backslash would turn off sbatch's %A/%a: every task would append to one file.
    (changed(launch={"slurm": {"log_dir": "lo\\gs"}}), [], "holds a backslash, which turns off sbatch's %A/%a"),
    # A file where the job's folder goes: a traceback, and the study's database left behind.
    (changed(launch={"slurm": {"log_dir": "study.yaml"}}), [], "launch.slurm.log_dir: "),
    (changed(launch={"slurm": {"log_dir": "study.yaml/logs"}}), [], "study.yaml is a file; the job's script, "
                                                                     "storage file and logs need a folder there"),
    # A GPU type with no count was dropped from the script: a job with no GPU, submitted with exit 0 (review).
    (changed(launch={"slurm": {"gpu_type": "a100"}}), [], "study.yaml: launch.slurm.gpu_type: 'a100' needs a GPU "
                                                          "count too: give launch.slurm.gpus_per_task"),
])
def test_bad_launch_options_exit_2_with_one_line_and_nothing_created(tmp_path: Path, document: dict[str, Any],
                                                                     args: list[str], expected: str) -> None:
    path = write_study(tmp_path, document)
    before = created(tmp_path)
    done = sweep_cli("submit", path, "--slurm", *args, cwd=tmp_path)  # not a dry run: it would submit
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert created(tmp_path) == before


@pytest.mark.parametrize(("flags", "expected"), [
    (["--slurm", "--dry-run", "--image", "img:1"], "--image: --k8s's, not --slurm's"),
    (["--k8s", "--image", "img:1", "--partition", "gpu", "--mem", "4G"], "--partition, --mem: --slurm's, not --k8s's"),
    (["--k8s", "--image", "img:1", "--dry-run"], "--dry-run: --slurm's, not --k8s's"),
])
def test_an_option_of_the_other_launcher_is_refused_naming_it(tmp_path: Path, flags: list[str], expected: str) -> None:
    # It was ignored without a word.
    done = sweep_cli("submit", write_study(tmp_path, changed()), *flags, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == f"error: {expected} (see sweep submit --help)", done.stderr


@pytest.mark.parametrize("flags", [[], ["--slurm", "--k8s"]])
def test_submit_needs_exactly_one_launcher(tmp_path: Path, flags: list[str]) -> None:
    done = sweep_cli("submit", write_study(tmp_path, changed()), *flags, cwd=tmp_path)
    assert done.returncode == 2 and "give one of --slurm" in done.stderr


def test_without_slurm_commands_nothing_is_created(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed())
    before = created(tmp_path)
    empty = tmp_path / "bin"
    empty.mkdir()
    done = sweep_cli("submit", path, "--slurm", cwd=tmp_path, env={"PATH": str(empty)})
    assert done.returncode == 1
    assert "sbatch not found" in done.stderr and "--dry-run" in done.stderr
    assert created(tmp_path) == before | {"bin"}  # the study is created only when it can be submitted


def test_the_storage_file_is_owner_only_and_gives_workers_the_url(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "job" / "storage.json"
    path.parent.mkdir()
    path.write_text("{}")
    os.chmod(path, 0o644)  # an older file with open modes is not reused as it is
    monkeypatch.setenv("PGPASSWORD", "from-libpq")
    write_storage_file(path, URL)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.delenv("PGPASSWORD")
    monkeypatch.setenv(STORAGE_FILE_ENV, str(path))
    assert storage_from_environment() == URL
    assert os.environ["PGPASSWORD"] == "from-libpq"  # libpq's variable travels in the file too
    for text in ("not json", "[1]", '{"url": 3}', '{"url": "URL", "env": [1]}', '{"url": "URL", "env": {"A": null}}',
                 '{"url": "URL", "env": {"A": 1}}'):
        path.write_text(text.replace("URL", URL))
        with pytest.raises(ValueError, match="not a storage file written by sweep submit"):
            storage_from_environment()
        assert "A" not in os.environ  # nothing of a refused file is set (a null was set as the text "None")


def test_a_worker_whose_storage_file_is_missing_exits_2_naming_it(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed())
    missing = tmp_path / "gone" / "storage.json"
    done = sweep_cli("run", path, cwd=tmp_path, env={"SWEEP_WORKER": "0", STORAGE_FILE_ENV: str(missing)})
    assert done.returncode == 2
    assert "cannot read the storage URL its launcher left" in done.stderr and str(missing) in done.stderr
    assert not (tmp_path / "tiny.db").exists()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_worker_whose_storage_file_is_no_regular_file_exits_2_at_once(tmp_path: Path, kind: str) -> None:
    # A named pipe there hung the worker for good (past SIGTERM and Ctrl-C); /dev/zero filled its memory.
    path = write_study(tmp_path, changed())
    odd = Path("/dev/zero")
    if kind == "fifo":
        odd = tmp_path / "storage.json"
        os.mkfifo(odd)
    env = {**os.environ, "SWEEP_WORKER": "0", STORAGE_FILE_ENV: str(odd)}  # a process of its own: it may hang
    done = subprocess.run([sys.executable, "-m", "sweep.cli", "run", str(path)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot read the storage URL its launcher left: {odd}: " in lines[0], lines
    assert "not a regular file" in lines[0] and not (tmp_path / "tiny.db").exists()


def test_every_sweep_submit_the_readme_shows_prints_its_script(tmp_path: Path) -> None:
    """Each `sweep submit` command of the README, as written, with --dry-run added where it would submit."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^sweep submit studies/.*$", readme, flags=re.M)
    assert len(commands) >= 2
    before = created(ROOT / "studies")
    for command in commands:
        words = shlex.split(command)[1:]
        words += [] if "--dry-run" in words else ["--dry-run"]
        done = sweep_cli(*words, cwd=ROOT)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        assert done.stdout.startswith("#!/bin/bash") and "#SBATCH --array=0-7" in done.stdout, command
    assert created(ROOT / "studies") == before


# -- Kubernetes ---------------------------------------------------------------------------------------------------

def k8s_documents(tmp_path: Path, *args: str, document: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    path = write_study(tmp_path, document or changed(storage=URL))
    out = tmp_path / "job.yaml"
    done = sweep_cli("submit", path, "--k8s", "-o", out, *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert PASSWORD not in text and "db.example" not in text  # the URL comes from the Secret
    return list(yaml.safe_load_all(text))


def test_k8s_manifest_is_an_indexed_job_the_kubernetes_models_accept(tmp_path: Path) -> None:
    kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (the test extra) is not installed")
    config_map, job = k8s_documents(tmp_path, "--image", "ghcr.io/lab/sweep:1", "--workers", "4",
                                    "--gpus-per-task", "1")
    client = kubernetes.client.ApiClient()
    for manifest, kind in ((config_map, "V1ConfigMap"), (job, "V1Job")):
        model = client._ApiClient__deserialize(manifest, kind)  # the client's own models
        # A misspelt or misplaced key is dropped by the models: what survives the round trip is all of it.
        assert client.sanitize_for_serialization(model) == manifest
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    pod = spec["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120 and pod["restartPolicy"] == "Never"
    [container] = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert container["command"][:5] == ["python", "-m", "sweep", "run", "/etc/sweep/study.yaml"]
    env = {item["name"]: item["valueFrom"] for item in container["env"]}
    assert env["SWEEP_STORAGE_URL"] == {"secretKeyRef": {"name": "sweep-storage", "key": "url"}}
    assert "job-completion-index" in env["SWEEP_WORKER"]["fieldRef"]["fieldPath"]
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    assert any(rule["action"] == "Ignore" and rule.get("onExitCodes", {}).get("values") == [143] for rule in rules)
    study = yaml.safe_load(config_map["data"]["study.yaml"])
    assert "storage" not in study and study["name"] == "tiny"


def test_k8s_names_are_ascii_and_two_studies_never_share_one(tmp_path: Path) -> None:
    # Review: `étude_Ⅻ²` gave the Job `sweep-étude-ⅻ²` (no DNS-1123 name: `kubectl apply` refuses it), and `a_b` and
    # `a.b` both gave `sweep-a-b` (one study's ConfigMap replaced the other's).
    def name(study: str) -> str:
        _, job = k8s_documents(tmp_path, "--image", "reg/sweep:1", document=changed(name=study, storage=URL))
        assert job["spec"]["template"]["metadata"]["labels"]["sweep/study"] == job["metadata"]["name"]
        return job["metadata"]["name"]

    names = [name(study) for study in ("tiny", "a_b", "a.b", "étude_Ⅻ²", "x" * 60, "x" * 61)]
    assert names[0] == "sweep-tiny" and len(set(names)) == len(names), names
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", n) for n in names), names


def test_a_negative_k8s_memory_is_refused(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed(storage=URL, launch={"k8s": {"memory": "-8Gi"}}))
    done = sweep_cli("submit", path, "--k8s", "--image", "reg/sweep:1", "-o", tmp_path / "job.yaml", cwd=tmp_path)
    assert done.returncode == 2 and "launch.k8s.memory: expected a Kubernetes quantity" in done.stderr, done.stderr
    assert not (tmp_path / "job.yaml").exists()


@pytest.mark.parametrize(("cpus", "expected"), [(1e-300, "greater than or equal to 0.001, got 1e-300"),
                                                (0.0005, "greater than or equal to 0.001, got 0.0005")])
def test_a_k8s_cpu_request_finer_than_a_millicore_is_refused(tmp_path: Path, cpus: float, expected: str) -> None:
    # Kubernetes counts CPU in thousandths: 1e-300 passed `> 0` and asked for a CPU request of nothing.
    path = write_study(tmp_path, changed(storage=URL, launch={"k8s": {"cpus_per_worker": cpus}}))
    done = sweep_cli("submit", path, "--k8s", "--image", "reg/sweep:1", "-o", tmp_path / "job.yaml", cwd=tmp_path)
    assert done.returncode == 2 and f"launch.k8s.cpus_per_worker: Input should be {expected}" in done.stderr, \
        done.stderr
    assert not (tmp_path / "job.yaml").exists()


def test_k8s_config_map_key_is_one_kubernetes_takes_whatever_the_study_file_is_called(tmp_path: Path) -> None:
    """`my study.yaml` was the ConfigMap's key, which the API server refuses (keys are `[-._a-zA-Z0-9]+`)."""
    path = write_study(tmp_path, changed(storage=URL), name="my study (v2).yaml")
    out = tmp_path / "job.yaml"
    done = sweep_cli("submit", path, "--k8s", "-o", out, "--image", "reg/sweep:1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    config_map, job = yaml.safe_load_all(out.read_text())
    [key] = config_map["data"]
    assert re.fullmatch(r"[-._a-zA-Z0-9]+", key) and key == "my-study--v2-.yaml"
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][4] == f"/etc/sweep/{key}"
    assert container["command"][5:7] == ["--study-name", "tiny"]  # the study's name is not the file's


def test_k8s_warns_of_what_a_pod_would_write_to_its_own_disk(tmp_path: Path) -> None:
    """In a pod the study file's folder (the ConfigMap) is read-only, so default and relative destinations go to the
    pod's working folder and are lost with it; the submit said nothing of it."""
    local = changed(storage=URL, tracking={"tensorboard": True, "mlflow": True})
    path = write_study(tmp_path, local)
    done = sweep_cli("submit", path, "--k8s", "-o", tmp_path / "job.yaml", "--image", "reg/sweep:1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("warning: in a pod, checkpoints.store, tracking.tensorboard.dir, tracking.mlflow.tracking_uri would be "
            "written in the pod's own working folder") in done.stderr
    shared = changed(storage=URL, checkpoints={"store": "s3://bucket/sweep"},
                     tracking={"tensorboard": {"dir": "/mnt/shared/tb"},
                               "mlflow": {"tracking_uri": "http://mlflow.internal:5000"}})
    path = write_study(tmp_path, shared)
    done = sweep_cli("submit", path, "--k8s", "-o", tmp_path / "job2.yaml", "--image", "reg/sweep:1", cwd=tmp_path)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    driver = changed(storage=URL, checkpoints={"store": "s3://bucket/sweep"},
                     tracking={"mlflow": {"tracking_uri": "sqlite+pysqlite:///mlflow.db"}})
    path = write_study(tmp_path, driver)  # a relative SQLite store named with its driver is as local
    done = sweep_cli("submit", path, "--k8s", "-o", tmp_path / "job3.yaml", "--image", "reg/sweep:1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning: in a pod, tracking.mlflow.tracking_uri would be written" in done.stderr


def test_k8s_manifest_to_dash_goes_to_stdout_as_best_s_and_report_s_do(tmp_path: Path) -> None:
    # Review: `-o -` wrote a file named `-` and said "`kubectl apply -f -`", which reads stdin.
    path = write_study(tmp_path, changed(storage=URL))
    done = sweep_cli("submit", path, "--k8s", "--image", "reg/sweep:1", "-o", "-", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [d["kind"] for d in yaml.safe_load_all(done.stdout)] == ["ConfigMap", "Job"]
    assert not (tmp_path / "-").exists() and "wrote" not in done.stderr


def test_k8s_needs_an_image(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed())
    done = sweep_cli("submit", path, "--k8s", "-o", tmp_path / "job.yaml", cwd=tmp_path)
    assert done.returncode == 2 and "--image: required with --k8s" in done.stderr
    assert not (tmp_path / "job.yaml").exists()



def test_sbatch_gets_no_variable_that_holds_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    from sweep.launch.slurm import _clean_environment

    monkeypatch.setenv("PGPASSWORD", "from-libpq")
    monkeypatch.setenv("SWEEP_STORAGE_URL", URL)
    monkeypatch.setenv("MY_DATABASE", URL)  # a variable of the user's own
    monkeypatch.setenv("DB_PASS", PASSWORD)
    kept = _clean_environment(URL)
    assert {"PGPASSWORD", "SWEEP_STORAGE_URL", "MY_DATABASE", "DB_PASS"}.isdisjoint(kept)
    assert kept["PATH"] == os.environ["PATH"]  # everything else goes to the job as sbatch always sends it
    short = "postgresql+psycopg://sweeper:a@db.example/sweeps"  # a one-letter password is inside PATH: kept
    assert _clean_environment(short)["PATH"] == os.environ["PATH"]
    # ...but not a variable that holds it as a URL or a keyword list does (review: the whole URL of a 3-character
    # password reached sbatch).
    monkeypatch.setenv("MY_DATABASE", "postgresql+psycopg://r3:q7z@127.0.0.1:5432/sw")
    monkeypatch.setenv("MY_DSN", "host=127.0.0.1 password=q7z dbname=sw")
    monkeypatch.setenv("MY_QUERY", "postgresql+psycopg://127.0.0.1/sw?user=r3&password=q7z")
    forms = {"MY_QUOTED": "password='q7z'", "MY_LINES": "password=q7z\nhost=h", "MY_ADO": "Server=h;Password=q7z;D=d",
             "MY_LIST": "PASSWORD=q7z,host=h", "MY_JSON": '{"password": "q7z"}'}  # diff review: these were kept
    for name, value in forms.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MY_WORDS", "q7zx and xq7z")  # no key gives it: kept
    kept = _clean_environment("postgresql+psycopg://r3:q7z@127.0.0.1:5432/sw")
    assert {"MY_DATABASE", "MY_DSN", "MY_QUERY", *forms}.isdisjoint(kept) and kept["PATH"] == os.environ["PATH"]
    assert kept["MY_WORDS"] == "q7zx and xq7z"
    # The password given by PGPASSWORD (the README's own example), not in the URL: a variable holding it as it is, or
    # percent-encoded in a URL, is not sent either (review: only PGPASSWORD itself was removed).
    secret = 'Sup3r$ecr"et pw'
    monkeypatch.setenv("PGPASSWORD", secret)
    monkeypatch.setenv("DB_PASSWORD", secret)
    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres:Sup3r%24ecr%22et%20pw@127.0.0.1:5432/sweep")
    monkeypatch.setenv("MY_TOKEN_COPY", "abc-token-123")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "abc-token-123")
    kept = _clean_environment("postgresql+psycopg://postgres@127.0.0.1:5432/sweep")
    assert {"PGPASSWORD", "DB_PASSWORD", "DATABASE_URL", "MY_TOKEN_COPY", "MLFLOW_TRACKING_TOKEN"}.isdisjoint(kept)
    assert kept["PATH"] == os.environ["PATH"]
    # ...while a list of folders one of whose names holds its letters goes to the job (diff review: PGPASSWORD=sweep
    # and a virtual environment in ~/sweep/.venv dropped PATH).
    monkeypatch.setenv("PGPASSWORD", "sweep")
    monkeypatch.setenv("PATH", f"/home/me/sweep/.venv/bin{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("VIRTUAL_ENV", "/home/me/sweep/.venv")
    monkeypatch.setenv("MY_URL", "postgresql://me:sweep@127.0.0.1/db")
    kept = _clean_environment("postgresql+psycopg://me@127.0.0.1:5432/db")
    assert kept["PATH"] == os.environ["PATH"] and kept["VIRTUAL_ENV"] == "/home/me/sweep/.venv"
    assert "MY_URL" not in kept and "PGPASSWORD" not in kept


def test_nodes_with_gpus_per_task_is_an_array_of_whole_nodes(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed(storage=URL))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", "--nodes", "3", "--gpus-per-task", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert {"#SBATCH --array=0-2", "#SBATCH --gres=gpu:4"} <= set(lines)
    assert any(line.strip().endswith("--workers 4 &") for line in lines)  # four workers, one per GPU, on each node
    for args in (["--nodes", "3"], ["--nodes", "3", "--workers", "2", "--gpus-per-task", "1"]):
        refused = sweep_cli("submit", path, "--slurm", "--dry-run", *args, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.startswith("error: --nodes: give it with --slurm and "
                                                                    "--gpus-per-task"), refused.stderr


def test_a_task_s_and_a_pod_s_gpus_follow_devices_per_trial(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed(storage=URL, resources={"devices_per_trial": 2}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", "--workers", "3", "--gpus-per-task", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert {"#SBATCH --array=0-2", "#SBATCH --gres=gpu:4"} <= set(lines)
    assert any(line.strip().endswith("--workers 2 &") for line in lines)  # two workers of 2 GPUs each per task
    assert any("a worker on each 2" in line for line in lines)
    for gpus in ("3", "1"):
        refused = sweep_cli("submit", path, "--slurm", "--dry-run", "--gpus-per-task", gpus, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.startswith(
            "error: --gpus-per-task: expected a multiple of resources.devices_per_trial (2)"), refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    # From the study file, the file's key is named: --gpus-per-task was named where it had not been given.
    for form, key in (("--slurm", "slurm.gpus_per_task"), ("--k8s", "k8s.gpus_per_worker")):
        refused = sweep_cli("submit", path, form, "--dry-run" if form == "--slurm" else "--image=i:1",
                            "--set", f"launch.{key}=3", *([] if form == "--slurm" else ["-o", tmp_path / "k.yaml"]),
                            cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.startswith(
            f"error: {path}: launch.{key}: expected a multiple of resources.devices_per_trial (2)"), refused.stderr
    cpu = sweep_cli("submit", path, "--slurm", "--dry-run", "--workers", "3", cwd=tmp_path)  # ranks on the CPU
    assert cpu.returncode == 0 and "--gres" not in cpu.stdout and "--workers 2" not in cpu.stdout, cpu.stderr
    pods = write_study(tmp_path, changed(storage=URL, resources={"devices_per_trial": 2}), name="pods.yaml")
    out = tmp_path / "job.yaml"
    done = sweep_cli("submit", pods, "--k8s", "-o", out, "--image", "img:1", "--gpus-per-task", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [container] = list(yaml.safe_load_all(out.read_text()))[1]["spec"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["--workers", "2"]  # two workers of 2 GPUs each per pod
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    refused = sweep_cli("submit", pods, "--k8s", "-o", out, "--image", "img:1", "--gpus-per-task", "3", cwd=tmp_path)
    assert refused.returncode == 2 and "expected a multiple of resources.devices_per_trial (2)" in refused.stderr


def test_local_workers_get_devices_per_trial_gpus_each() -> None:
    from sweep.workers import device_groups

    assert device_groups(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]
    assert device_groups(["0", "1", "2", "3"], 4, 1) == ["0", "1", "2", "3"]
    assert device_groups([], 5, 2) == []  # no GPU: any number of workers, on the CPU
    with pytest.raises(ValueError, match="needs 2 GPUs per worker, but 1 are visible"):
        device_groups(["0"], 1, 2)


@pytest.mark.parametrize(("how", "where"), [(("--slurm", "--dry-run"), "set"), (("--k8s", "--image", "img"), "set"),
                                            (("--k8s", "--image", "img"), "file")])
def test_a_tracking_uri_with_a_password_is_refused_by_submit(tmp_path: Path, how: tuple[str, ...], where: str) -> None:
    # The workers' command line (--set) and, for --k8s, the study file in a ConfigMap carried MLflow's password in
    # plain text: the batch script Slurm keeps, the manifest anyone who reads the Job sees.
    uri = "http://carol:TRKPW@127.0.0.1:5000"
    document = changed(tracking={"mlflow": {"tracking_uri": uri}}) if where == "file" else changed()
    path = write_study(tmp_path, document)
    extra = ("--set", f"tracking.mlflow.tracking_uri={uri}") if where == "set" else ()
    done = sweep_cli("submit", path, *how, *extra, "-o", tmp_path / "job.yaml", cwd=tmp_path) if how[0] == "--k8s" \
        else sweep_cli("submit", path, *how, *extra, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "tracking.mlflow.tracking_uri: holds a password" in done.stderr, done.stderr
    assert "TRKPW" not in done.stdout + done.stderr and not (tmp_path / "job.yaml").exists()


def test_a_tracking_uri_with_a_password_in_the_study_file_is_no_part_of_the_batch_script(tmp_path: Path) -> None:
    uri = "postgresql://carol:TRKPW@127.0.0.1:5432/mlflow"  # the script names the file; it holds no copy of it
    path = write_study(tmp_path, changed(tracking={"mlflow": {"tracking_uri": uri}}))
    for other in ((), ("--set", "tracking.mlflow.experiment=x")):  # another key given on the command line
        done = sweep_cli("submit", path, "--slurm", "--dry-run", *other, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "TRKPW" not in done.stdout + done.stderr


def test_mlflow_s_password_travels_in_the_owner_only_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sweep.launch.slurm import _clean_environment

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "from-mlflow")
    assert "MLFLOW_TRACKING_PASSWORD" not in _clean_environment("sqlite:///x.db")  # not in Slurm's records
    write_storage_file(tmp_path / "storage.json", "sqlite:///x.db")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    monkeypatch.setenv(STORAGE_FILE_ENV, str(tmp_path / "storage.json"))
    assert storage_from_environment() == "sqlite:///x.db"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "from-mlflow"  # the worker has it again


@pytest.mark.parametrize(("given", "written"), [
    ("--gres=gpu:2", "--gres=gpu:2"), ("--array=0-3%2", "--array=0-3%2"), ("--constraint=a100|h100", None),
    ("--output=/a b/%A_%a.log", '--output="/a b/%A_%a.log"'), ("--comment=issue#5", '--comment="issue#5"'),
    ('--export=ALL,X="a b"', None),  # quoted by the user: theirs, as written (the job sees X=a b)
    ("--comment='say hi'", None), ("--comment=\"it's\"", None),
    # quotes sbatch would not read as one word: quoted whole, their own escaped (review: "Unmatched `'`")
    ("--comment=say 'hi'", '--comment="say \'hi\'"'), ("--comment=it's", '--comment="it\'s"'),
    ('--comment=say "hi" now', '--comment="say \\"hi\\" now"'),
    ("--time=10   # ten minutes", None), ("--partition  debug", "--partition debug"),
    ("--exclusive  # whole nodes", "--exclusive"),
])
def test_sbatch_values_are_quoted_only_where_sbatch_would_split_them(given: str, written: str | None) -> None:
    from sweep.launch.slurm import sbatch_quoted

    assert sbatch_quoted(given) == (given if written is None else written)


@pytest.mark.parametrize("limit", ["0", "3", "2:01", "1-0", "0-0:2:30"])
def test_a_time_limit_longer_than_the_warning_or_none_is_taken(tmp_path: Path, limit: str) -> None:
    path = write_study(tmp_path, changed(launch={"slurm": {"time": limit, "warning_s": 120}}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"#SBATCH --time={limit}\n" in done.stdout
    # The study file's warning and the command line's time are judged together, not against the defaults.
    path = write_study(tmp_path, changed(launch={"slurm": {"warning_s": 10}}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", "--time", "0:20", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_log_folder_with_quotes_percent_and_hash_is_one_quoted_output_directive(tmp_path: Path) -> None:
    """A folder holding a quote went into the script as written (sbatch's own quote handling then cut the path, and
    the tasks failed with no log); a `%x` in it was expanded by sbatch into the job's name."""
    path = write_study(tmp_path, changed(launch={"slurm": {"log_dir": "it's \"%x\" #1"}}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [output] = [line for line in done.stdout.splitlines() if line.startswith("#SBATCH --output=")]
    assert output == f'#SBATCH --output="{tmp_path}/it\'s \\"%%x\\" #1/%A_%a.log"'
    assert subprocess.run(["bash", "-n"], input=done.stdout, text=True).returncode == 0


def test_sacct_lines_become_the_tasks_of_a_job_slurm_has_forgotten() -> None:
    """`sweep status` asks accounting once the controller has forgotten a job (MinJobAge): a failed task is still
    shown failed. (No accounting daemon runs here; these are sacct's own lines for such a job.)"""
    from sweep.launch.slurm import SlurmTask, parse_sacct

    text = ("77_0|COMPLETED|0:0\n77_1|FAILED|1:0\n77_1.batch|FAILED|1:0\n77_[2-4]|CANCELLED by 0|0:0\n"
            "770_1|FAILED|2:0\n77_5|TIMEOUT|0:15\n")
    records = parse_sacct("77", text)
    assert [(r["ArrayTaskId"], r["JobState"], r["ExitCode"]) for r in records] == [
        ("0", "COMPLETED", "0:0"), ("1", "FAILED", "1:0"), ("2-4", "CANCELLED", "0:0"), ("5", "TIMEOUT", "0:15")]
    labels = [SlurmTask("77", r["ArrayTaskId"], r["JobState"], 0, r["ExitCode"], "", None).label for r in records]
    assert labels == ["done", "failed", "cancelled", "failed"]


@pytest.mark.parametrize("option", ["--gres=nvme:1", "-p debug", "-Hv", "--exclusive", "--exclude=node1",
                                    "--mem-per-cpu=2G", "--time-min=10", "-J name", "--nice=5"])
def test_sbatch_options_that_sweep_does_not_set_are_taken(tmp_path: Path, option: str) -> None:
    path = write_study(tmp_path, changed())
    done = sweep_cli("submit", path, "--slurm", "--dry-run", "--sbatch", option, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"#SBATCH {option}\n" in done.stdout


def test_a_gpu_type_is_asked_for_with_the_task_s_gpus(tmp_path: Path) -> None:
    path = write_study(tmp_path, changed(launch={"slurm": {"gpu_type": "a100", "gpus_per_task": 2}}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --gres=gpu:a100:2\n" in done.stdout and " --workers 2 &" in done.stdout


def test_a_log_dir_under_the_home_folder_is_the_home_folder_s(tmp_path: Path) -> None:
    # Found by the mutation fuzz: `~/logs` became a folder named `~` beside the study file, where `checkpoints.store`
    # and the TensorBoard folder expand it.
    path = write_study(tmp_path, changed(launch={"slurm": {"log_dir": "~/sweep-logs"}}))
    done = sweep_cli("submit", path, "--slurm", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f'#SBATCH --output="{Path("~/sweep-logs").expanduser()}/%A_%a.log"' in done.stdout.splitlines()
