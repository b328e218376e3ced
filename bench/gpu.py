"""How fast is the trainer on a GPU, and how busy does a study keep it?

    python bench/gpu.py                          # every part, about 3-4 minutes on an H100/H200
    python bench/gpu.py --parts eager compiled   # only these parts
    python bench/gpu.py --out results/           # also write results/gpu.json
    python bench/gpu.py --smoke                  # tiny sizes on the CPU: checks the script, not the machine

Parts, each in its own process with its own time limit (a part that runs over is killed and reported as such):
- `eager`, `compiled`, `graphs`: tokens/s and model-FLOPs utilisation (MFU) of studies/charlm.yaml's model (its fixed
  values, copied below: d=384, 6 layers, 6 heads, context 256, batch 64, AdamW, clip 1.0, bf16 autocast) trained by
  `trainer.train` for `--steps` steps, eager, with `compile: true`, and with `compile_mode: reduce-overhead` too (CUDA
  graphs; not among the default parts, `bench/gpu_all.sh` runs it last, with the time left). Tokens/s is the median of
  the trainer's own logged `tokens_per_s` over the log intervals after the first two, so warm-up and compilation are
  left out. FLOPs per token = 6 N + 12 L d T: N the parameters that do matmul work (all but the position embedding;
  the tied token embedding counts once, for the output head), plus attention scores and values counted in full (T x T,
  not halved for the causal mask), as in the PaLM paper and nanoGPT. MFU = tokens/s x FLOPs per token /
  `--peak-tflops` (default 989: H100/H200 SXM dense BF16 without sparsity; the table says which peak was used).
- `trials`: trials per GPU-hour for the quickstart-sized model (studies/quickstart.yaml's fixed values: the digits MLP,
  600 steps at batch 64, evaluation every 50), one trial at a time through `trainer.train` in one process with the
  task loaded once, as a sweep worker does. One warm-up trial, then `--trials` timed ones.
- `study`: a short real study, `python -m sweep.cli run --study PATH` (default studies/quickstart.yaml), on a
  throwaway SQLite file; needs optuna (skipped, and said so, where it is missing).
GPU utilisation is sampled by `nvidia-smi --query-gpu=utilization.gpu -lms 200` in the background while each part
runs: for `eager`/`compiled`/`graphs` over the timed log intervals only, for `trials` and `study` from the first busy
sample to the last. The figure is the share of each sample period in which any kernel ran (not how full the SMs were).

Imports torch and trainer only; the study part runs the sweep CLI in a subprocess.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # trainer, without installing the project
PARTS = ("eager", "compiled", "graphs", "trials", "study")
DEFAULT_PARTS = ("eager", "compiled", "trials", "study")
TIME_LIMITS_S = {"eager": 75, "compiled": 150, "graphs": 150, "trials": 60, "study": 75}  # the default parts: 6 min
COMPILE = {"eager": {}, "compiled": {"compile": True}, "graphs": {"compile": True, "compile_mode": "reduce-overhead"}}

# studies/charlm.yaml: task and fixed values (kept in step by hand; the learning rate is a mid-range pick of its space).
CHARLM = {"task": "charlm", "task_args": {"context": 256, "max_chars": 4_000_000}, "batch_size": 64,
          "gradient_clip_norm": 1.0, "optimizer": "adamw", "scheduler": "cosine", "min_lr_ratio": 0.1,
          "learning_rate": 1e-3, "warmup_steps": 50, "eval_batch_size": 256,
          "model": {"d_model": 384, "n_layers": 6, "n_heads": 6}}
CHARLM_SMOKE = {**CHARLM, "task_args": {"context": 32, "max_chars": 100_000}, "batch_size": 8, "warmup_steps": 0,
                "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}}
# studies/quickstart.yaml: task and fixed values, with mid-range picks of its space.
QUICKSTART = {"task": "digits", "max_steps": 600, "batch_size": 64, "eval_every_steps": 50, "log_every_steps": 50,
              "warmup_steps": 30, "optimizer": "adamw", "learning_rate": 3e-3, "model": {"hidden": 64, "depth": 2}}


# ---------------------------------------------------------------------------------------------------------------------
# GPU utilisation, sampled by nvidia-smi in the background.

class UtilizationSampler:
    """`nvidia-smi ... -lms 200` in a subprocess. Each sample carries nvidia-smi's own timestamp (the host's local
    clock when it was taken), not the time its line arrives: a pipe may deliver the lines in bursts."""

    def __init__(self, period_ms: int = 200) -> None:
        self.samples: list[tuple[float, float]] = []
        self.error: str | None = None
        self._proc: subprocess.Popen | None = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "nvidia-smi not found"
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        try:
            self._proc = subprocess.Popen(
                [exe, f"--id={visible}", "--query-gpu=timestamp,utilization.gpu", "--format=csv,noheader,nounits",
                 "-lms", str(period_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError as exc:
            self.error = f"nvidia-smi failed to start: {exc}"
            return
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._proc is not None and not self.samples and self.error is None:
            self.error = "nvidia-smi gave no samples"

    def mean(self, start: float | None = None, end: float | None = None) -> float | None:
        """Mean over [start, end]; without bounds, from the first busy sample to the last."""
        samples = self.samples
        if start is None or end is None:
            busy = [i for i, (_, value) in enumerate(samples) if value > 0]
            samples = samples[busy[0] : busy[-1] + 1] if busy else []
        else:
            samples = [(t, v) for t, v in samples if start <= t <= end]
        return statistics.fmean(v for _, v in samples) if samples else None


def parse_sample(line: str) -> tuple[float, float] | None:
    """`2026/11/30 05:40:12.345, 87` -> (epoch seconds, 87.0); the arrival time when the stamp does not parse."""
    stamp, _, value = line.rpartition(",")
    try:
        utilization = float(value.strip())
    except ValueError:
        return None
    try:
        taken = datetime.datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time
    except ValueError:
        taken = time.time()
    return taken, utilization


# ---------------------------------------------------------------------------------------------------------------------
# The parts. Each runs in a child process (`--child PART`) and prints one JSON line.

def flops_per_token(config: Mapping) -> tuple[int, float]:
    """(N, FLOPs per token) for the charlm model of `config`; see the module docstring."""
    from trainer import load_task

    task = load_task("charlm", {**config["task_args"], "max_chars": 20_000})  # the model only: little text
    model = task.build_model(task.model_config(config["model"]))
    n = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
    layers, d, t = config["model"]["n_layers"], config["model"]["d_model"], config["task_args"]["context"]
    return n, 6 * n + 12 * layers * d * t


class LogClock:
    def __init__(self) -> None:
        self.logs: list[tuple[float, Mapping[str, float]]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.logs.append((time.time(), dict(metrics)))

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        return False


def part_throughput(args: argparse.Namespace, part: str) -> dict:
    import torch

    from trainer import TrainingConfig, load_task, train

    base = CHARLM_SMOKE if args.smoke else CHARLM
    steps = args.steps
    log_every = max(1, steps // 12)
    config = TrainingConfig.from_dict({**base, "max_steps": steps, "log_every_steps": log_every,
                                       "eval_every_steps": steps, **COMPILE[part], "device": args.device})
    task = load_task("charlm", base["task_args"])
    clock = LogClock()
    started = time.time()
    result = train(config, task, clock)
    timed = clock.logs[2:] if len(clock.logs) > 3 else clock.logs[-1:]
    tokens_per_s = statistics.median(m["tokens_per_s"] for _, m in timed)
    n, per_token = flops_per_token(base)
    return {"tokens_per_s": tokens_per_s, "params": n, "flops_per_token": per_token,
            "tflops": tokens_per_s * per_token / 1e12, "mfu": tokens_per_s * per_token / (args.peak_tflops * 1e12),
            "peak_mem_mb": max((m.get("peak_mem_mb", 0.0) for _, m in clock.logs), default=0.0),
            "gpu_util_pct_logged": statistics.fmean(m["gpu_util_pct"] for _, m in timed)
            if all("gpu_util_pct" in m for _, m in timed) else None,
            "window": [clock.logs[1][0] if len(clock.logs) > 3 else started, clock.logs[-1][0]],
            "wall_s": time.time() - started, "steps": steps, "val_loss": result.metrics["val_loss"],
            "device": torch.cuda.get_device_name() if config.device != "cpu" and torch.cuda.is_available() else "cpu"}


def quickstart_task() -> tuple[object, str | None]:
    """The digits task, or where scikit-learn (which ships its data file) is missing, a stand-in of the same shapes:
    random 64-pixel images in 10 classes, 1,438 to train on and 359 to validate, and the same MLP. The work per
    trial, which is all this part measures, is the same."""
    import torch

    from trainer import Task, load_task
    from trainer.tasks import accuracy_sum
    from trainer.tasks.digits import MLP, MODEL_DEFAULTS

    try:
        return load_task("digits"), None
    except FileNotFoundError as exc:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.rand(1797, 64, generator=generator), torch.randint(0, 10, (1797,), generator=generator)
        task = Task(name="digits-shaped", train=(x[359:], y[359:]), val=(x[:359], y[:359]),
                    build_model=lambda cfg: MLP(64, 10, **cfg), model_defaults=MODEL_DEFAULTS,
                    eval_metrics=accuracy_sum, eval_metric_names=("accuracy",))
        return task, f"{exc}; timed a same-shaped stand-in"


def part_trials(args: argparse.Namespace) -> dict:
    from trainer import TrainingConfig, train

    values = {**QUICKSTART, "device": args.device}
    if args.smoke:
        values.update(max_steps=60, eval_every_steps=20, log_every_steps=20)
    config = TrainingConfig.from_dict(values)
    task, note = quickstart_task()
    train(config, task)  # warm-up: CUDA context, kernels, allocator
    walls = []
    for seed in range(args.trials):
        started = time.perf_counter()
        train(config.replace({"seed": seed}), task)
        walls.append(time.perf_counter() - started)
    return {"trials": len(walls), "trial_s_median": statistics.median(walls), "trial_s_mean": statistics.fmean(walls),
            "trials_per_hour": 3600 / statistics.median(walls), "steps": config.max_steps, "note": note}


def part_study(args: argparse.Namespace) -> dict:
    import importlib.util

    missing = [name for name in ("optuna", "sqlalchemy", "pydantic", "typer") if importlib.util.find_spec(name) is None]
    if missing:  # the sweep CLI's own dependencies; the other parts need torch only
        return {"skipped": f"{', '.join(missing)} not importable here"}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-study-") as folder:  # a throwaway study
        command = [sys.executable, "-m", "sweep.cli", "run", str(args.study), "--storage", f"sqlite:///{folder}/s.db",
                   "--study-name", "bench-gpu", "--n-trials", str(args.study_trials), "--timeout",
                   str(args.study_timeout), "--workers", str(args.study_workers)]
        if args.smoke:
            command += ["--set", "fixed.max_steps=40", "--set", "fixed.eval_every_steps=20", "--set",
                        "fixed.log_every_steps=20"]
        elif args.study_steps:
            command += ["--set", f"fixed.max_steps={args.study_steps}"]
        started = time.time()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False,
                              timeout=args.study_timeout + 60)
    return {"returncode": done.returncode, "wall_s": time.time() - started, "trials": args.study_trials,
            "workers": args.study_workers, "study": str(args.study), "steps": args.study_steps,
            "stderr_tail": done.stderr[-600:]}


def child(args: argparse.Namespace) -> None:
    if args.child in COMPILE:
        result = part_throughput(args, args.child)
    elif args.child == "trials":
        result = part_trials(args)
    else:
        result = part_study(args)
    print("RESULT " + json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------------
# The parent: one child per part, each sampled and time-limited.

def run_part(part: str, argv: list[str], limit_s: float) -> dict:
    """Run one part in a process group of its own. Whatever is left of the group when the part ends, is stopped or
    this script is (the study part's `sweep run` workers, say), is killed, so no part's leftovers load the next."""
    sampler = UtilizationSampler()
    started = time.time()
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", part, *argv], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=limit_s)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {"error": f"exit {child.returncode}: {stderr[-800:]}"}
    except subprocess.TimeoutExpired:
        result = {"error": f"ran past its limit of {limit_s:.0f} s and was stopped"}
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is already empty
        child.communicate()
        sampler.stop()
    result["part_wall_s"] = time.time() - started
    window = result.get("window")
    result["gpu_util_pct"] = sampler.mean(*window) if window else sampler.mean()
    result["gpu_util_note"] = sampler.error
    return result


def fmt(value: float | None, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def table(results: dict, args: argparse.Namespace) -> str:
    rows = ["| part | result | GPU busy (nvidia-smi) | notes |", "|---|---|---|---|"]
    for part, r in results.items():
        util = fmt(r.get("gpu_util_pct"), ".0f") + ("%" if r.get("gpu_util_pct") is not None else "")
        if "error" in r or "skipped" in r:
            rows.append(f"| {part} | {r.get('error') or r.get('skipped')} | {util} | |")
        elif part in COMPILE:
            rows.append(f"| charlm {part} | {r['tokens_per_s'] / 1e6:.3f}M tokens/s, {r['tflops']:.1f} TFLOP/s, "
                        f"MFU {100 * r['mfu']:.1f}% of {args.peak_tflops:g} TFLOP/s | {util} | "
                        f"{r['params'] / 1e6:.1f}M params, {r['flops_per_token'] / 1e6:.1f} MFLOP/token, "
                        f"peak {r['peak_mem_mb']:.0f} MiB, {r['steps']} steps, part {r['part_wall_s']:.0f} s |")
        elif part == "trials":
            rows.append(f"| quickstart trials | {r['trials_per_hour']:.0f} trials/GPU-hour "
                        f"({r['trial_s_median']:.2f} s per {r['steps']}-step trial) | {util} | "
                        f"median of {r['trials']}, one at a time{'; ' + r['note'] if r.get('note') else ''} |")
        else:
            steps = f", {r['steps']} steps each" if r.get("steps") else ""
            rows.append(f"| study ({Path(r['study']).name}, {r['trials']} trials{steps}, {r['workers']} worker(s)) | "
                        f"exit {r['returncode']}, {r['wall_s']:.0f} s | {util} | first to last busy sample |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS))
    parser.add_argument("--steps", type=int, default=None, help="training steps for the throughput parts (default 300)")
    parser.add_argument("--trials", type=int, default=8, help="timed trials for the trials part")
    parser.add_argument("--study", type=Path, default=ROOT / "studies" / "quickstart.yaml")
    parser.add_argument("--study-trials", type=int, default=12)
    parser.add_argument("--study-workers", type=int, default=1)
    parser.add_argument("--study-timeout", type=float, default=45.0, help="seconds, passed to sweep run --timeout")
    parser.add_argument("--study-steps", type=int, help="max_steps of the study's trials (default: the study's own)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the chip's dense BF16 peak for MFU (989: H100/H200 SXM)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every part's time limit")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: a check of this script")
    parser.add_argument("--out", type=Path, help="write DIR/gpu.json")
    parser.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Stopped from outside (gpu_all.sh's `timeout`): unwind, so that run_part kills the part that is running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.smoke:
        args.device = "cpu"
        args.steps = args.steps or 36
        args.trials = min(args.trials, 2)
        args.study_trials = min(args.study_trials, 2)
    args.steps = args.steps or 300
    if args.child:
        child(args)
        return

    argv = [f"--steps={args.steps}", f"--trials={args.trials}", f"--study={args.study}",
            f"--study-trials={args.study_trials}", f"--study-workers={args.study_workers}",
            f"--study-timeout={args.study_timeout}", f"--peak-tflops={args.peak_tflops}", f"--device={args.device}",
            *([f"--study-steps={args.study_steps}"] if args.study_steps else []),
            *(["--smoke"] if args.smoke else [])]
    results: dict[str, dict] = {}
    try:
        for part in args.parts:
            limit = TIME_LIMITS_S[part] * args.time_scale * (4 if args.smoke else 1)
            print(f"{part} (at most {limit:.0f} s) ...", file=sys.stderr, flush=True)
            results[part] = run_part(part, argv, limit)
            write(results, args)  # each part's figures are kept, even if a later part is cut short
    finally:  # also when stopped from outside: the table of the parts that ran
        report(results, args)


def machine() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"


def write(results: dict[str, dict], args: argparse.Namespace) -> None:
    if not args.out:
        return
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "torch": torch.__version__, "peak_tflops": args.peak_tflops, "smoke": args.smoke,
               "results": results}
    (args.out / "gpu.json").write_text(json.dumps(payload, indent=2))


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    import torch

    print(f"\nMachine: {machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, Python "
          f"{platform.python_version()}; MFU against {args.peak_tflops:g} TFLOP/s dense BF16\n")
    print(table(results, args))
    notes = {r["gpu_util_note"] for r in results.values() if r.get("gpu_util_note")}
    for note in sorted(notes):
        print(f"\nGPU utilisation: {note}")
    if args.out and results:
        print(f"\nwrote {args.out / 'gpu.json'}")


if __name__ == "__main__":
    main()
