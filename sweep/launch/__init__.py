"""Launchers: they start a study's workers somewhere else and never decide trials. Each worker is the ordinary
`sweep run` loop (sweep.worker) on the study's shared storage.

- `sweep.launch.slurm`: a Slurm job array (`sweep submit study.yaml --slurm`), requeued on preemption;
- `sweep.launch.k8s`: a Kubernetes Indexed Job manifest (`sweep submit study.yaml --k8s -o job.yaml`).

The local launcher (`sweep run --workers N`) is `sweep.workers`.
"""
