"""`sweep submit study.yaml --k8s -o job.yaml`: the study's workers as a Kubernetes Indexed Job (untested on a live
cluster; the tests check the manifest against the Kubernetes API's own models).

Two documents: a ConfigMap holding the study file, and a Job of `workers` pods (completion mode Indexed, each its
index as `SWEEP_WORKER`) running the same worker command as a Slurm array task, with the storage URL from a Secret
the user creates (`kubectl create secret generic sweep-storage --from-literal=url=...`), so the manifest holds no
password. Preemption: an evicted or preempted pod gets SIGTERM and `terminationGracePeriodSeconds` to checkpoint its
trial and exit 143; the pod failure policy does not count that (nor a disruption) against the Job's retries, and
the Job starts a new pod for the index, which continues the study. Exit code 2 (bad input) fails the Job at once.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sweep.schema import read_document
from sweep.workers import STORAGE_ENV, WORKER_ENV, worker_args

if TYPE_CHECKING:
    from sweep.schema import K8sSpec, StudySpec

__all__ = ["STUDY_MOUNT", "job_manifest"]

STUDY_MOUNT = "/etc/sweep"  # where the ConfigMap's study file appears in each pod


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people: no anchors, and the study file as a literal block."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)


def _name(spec: StudySpec) -> str:
    """A DNS-1123 name (and label value) from the study's, which may hold '_', '.' and letters beyond ASCII: those
    become '-', and a name that had any, or was cut to length, ends with a digest of the study's name, so that two
    studies (`a_b`, `a.b`) never share a Job, ConfigMap or label."""
    name = "".join(c if c.isascii() and c.isalnum() else "-" for c in spec.name.lower()).strip("-")
    if name == spec.name and len(name) <= 50:
        return f"sweep-{name}"
    digest = hashlib.sha256(spec.name.encode()).hexdigest()[:8]
    return f"sweep-{name[:40].strip('-') or 'study'}-{digest}"


def config_map_key(file_name: str) -> str:
    """The study file's name as a ConfigMap key (and its file's name in the pods), which Kubernetes takes only of
    `[-._a-zA-Z0-9]`: `my study.yaml` is `my-study.yaml`. The workers are given the study's name (`--study-name`),
    so the file's does not matter to them."""
    key = re.sub(r"[^-._a-zA-Z0-9]", "-", file_name)
    return "study.yaml" if key.strip(".") == "" else key


def job_manifest(spec: StudySpec, spec_path: Path, options: K8sSpec, *, timeout: float | None = None,
                 overrides: Sequence[str] = ()) -> str:
    """The ConfigMap and the Job as one YAML stream."""
    name = _name(spec)
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "sweep", "sweep/study": name}}
    if options.namespace:
        meta["namespace"] = options.namespace
    key = config_map_key(spec_path.name)
    study_file = f"{STUDY_MOUNT}/{key}"
    workers = options.gpus_per_worker // spec.resources.devices_per_trial  # one per trial's GPUs (gpus_problem)
    command = ["python", "-m", "sweep", "run",
               *worker_args(Path(study_file), spec, timeout=timeout, overrides=overrides),
               *(["--workers", str(workers)] if workers > 1 else [])]
    resources: dict[str, Any] = {}
    if options.gpus_per_worker:
        resources["limits"] = {"nvidia.com/gpu": str(options.gpus_per_worker)}  # quantities are strings
    requests = {key: f"{value:g}" if isinstance(value, float) else value
                for key, value in (("cpu", options.cpus_per_worker), ("memory", options.memory)) if value is not None}
    if requests:
        resources["requests"] = requests
    container: dict[str, Any] = {
        "name": "worker",
        "image": options.image,
        "command": command,
        "env": [
            {"name": WORKER_ENV, "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": STORAGE_ENV, "valueFrom": {"secretKeyRef": {"name": options.secret, "key": "url"}}},
        ],
        "volumeMounts": [{"name": "study", "mountPath": STUDY_MOUNT, "readOnly": True}],
    }
    if resources:
        container["resources"] = resources
    # The study file without its `storage:` (which may hold a password): the workers' URL is the Secret's.
    document = {key: value for key, value in read_document(spec_path).items() if key != "storage"}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                  "data": {key: yaml.safe_dump(document, sort_keys=False)}}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": options.workers,
            "parallelism": options.workers,
            "backoffLimit": 3 * options.workers,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                {"action": "Ignore", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [143]}},
                {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [2]}},
            ]},
            "template": {
                "metadata": {"labels": meta["labels"]},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": options.grace_period_s,
                    "containers": [container],
                    "volumes": [{"name": "study", "configMap": {"name": name}}],
                },
            },
        },
    }
    header = (f"# Workers of study {spec.name!r} as a Kubernetes Indexed Job (sweep submit --k8s). First:\n"
              f"#   kubectl create secret generic {options.secret} --from-literal=url='postgresql+psycopg://...'\n")
    return header + yaml.dump_all([config_map, job], Dumper=_Dumper, sort_keys=False)
