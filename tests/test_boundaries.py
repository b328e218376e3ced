"""The house rules: trainer/ imports torch, numpy and the standard library only; sweep/ is never imported by it; the
modules of trainer/ import each other without a cycle."""

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
        if path.name in ("__main__.py", "yaml_file.py"):
            extra -= {"yaml"}  # the command-line entry reads YAML config files (by yaml_file's rules, which sweep's
            # study files share); the library never does
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_name: str = "trainer") -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports: at module level, in functions, under
    TYPE_CHECKING alike (a function-level import hides a cycle, it does not remove it). `from trainer.x import y` is
    an edge to `trainer.x.y` when that is a module, else to `trainer.x`. A package's own `__init__`, which Python runs
    before any of its modules, is not counted as imported by them."""
    paths = sorted((ROOT / package_name).rglob("*.py"))
    modules = {module_name(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]`, or None (a depth-first search)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_trainer_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert graph["trainer.loop"] >= {"trainer.config", "trainer.checkpoint"}  # the parser sees the imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_sweep_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph("sweep")
    assert graph["sweep.worker"] >= {"sweep.runners", "sweep.checkpoints", "sweep.storage"}
    assert graph["sweep.runners"] >= {"sweep.objective", "sweep.runners.loop", "sweep.runners.command"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cli_s_help_status_and_trials_never_import_torch(tmp_path: Path) -> None:
    """`sweep --help` imports neither torch nor Optuna; `status` and `trials` read the storage with Optuna, without
    torch. Each in a fresh interpreter, the modules loaded read at its end."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = optuna.create_study(study_name="s", storage=storage)
    study.set_user_attr("sweep.spec", {"metric": "val_loss", "n_trials": 1})
    study.tell(study.ask(), 1.0)
    probe = ("import sys\nfrom sweep.cli import main\nsys.argv = ['sweep', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
             "print('LOADED', 'torch' in sys.modules, 'optuna' in sys.modules)\nsys.exit(code)")
    for args, optuna_too in ((["--help"], False), (["status", "--storage", storage, "s"], True),
                             (["trials", "--storage", storage, "s"], True)):
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == f"LOADED False {optuna_too}", (args, done.stdout[-300:])


def test_the_client_a_command_imports_is_the_standard_library_alone() -> None:
    """`from sweep import client` in a user's script costs no torch, Optuna, SQL or YAML import."""
    code = ("import sys; from sweep import client; client.report(1, val_loss=1.0); "
            "bad = [m for m in ('torch', 'optuna', 'sqlalchemy', 'yaml', 'pydantic', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # At module level the standard library alone; `save` and `load` import the trainer's checkpoint format (and so
    # torch) when they are called, which only a script that checkpoints does.
    tree = ast.parse((ROOT / "sweep" / "client.py").read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top
    assert imports(ROOT / "sweep" / "client.py") - top <= {"trainer"}


def test_the_import_cycle_check_finds_a_hidden_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
