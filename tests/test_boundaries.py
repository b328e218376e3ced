"""The house rules: trainer/ imports torch, numpy and the standard library only; sweep/ is never imported by it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"torch", "numpy", "trainer", "__future__"} | set(sys.stdlib_module_names)


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_trainer_imports_only_torch_numpy_and_stdlib() -> None:
    offenders = {}
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        extra = imports(path) - ALLOWED
        if path.name == "__main__.py":
            extra -= {"yaml"}  # the command-line entry reads YAML config files; the library never does
        if extra:
            offenders[str(path.relative_to(ROOT))] = sorted(extra)
    assert offenders == {}


def test_importing_and_training_pulls_in_no_optuna_or_sql() -> None:
    code = ("import sys, trainer, trainer.__main__; "
            "trainer.train(trainer.TrainingConfig.from_dict({'max_steps': 2, 'eval_every_steps': 2})); "
            "bad = [m for m in ('optuna', 'sqlalchemy', 'sweep', 'sklearn') if m in sys.modules]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
