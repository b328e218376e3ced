from __future__ import annotations

import subprocess
import sys

import pytest

from trainer.config import ConfigError, TrainingConfig, flatten, nest


def test_importing_the_config_loads_neither_torch_nor_numpy() -> None:
    # The sweep's command line (--help, status, trials) reads configs and study files; torch takes seconds to load.
    code = ("import sys, trainer.config\n"
            "from trainer.config import ConfigError, CurriculumConfig, FastFailConfig, TrainingConfig, flatten, nest\n"
            "TrainingConfig.from_dict({'fast_fail.patience_steps': 5, 'curriculum.schedule': 'linear'})\n"
            "loaded = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_the_settings_of_config_sections_are_the_ones_their_modules_use() -> None:
    from trainer import config, curriculum, fast_fail

    assert config.FastFailConfig is fast_fail.FastFailConfig
    assert config.CurriculumConfig is curriculum.CurriculumConfig


def test_defaults_are_valid() -> None:
    config = TrainingConfig.from_dict({})
    assert config == TrainingConfig()
    assert config.gradient_clip_norm is None  # clipping is off unless asked


@pytest.mark.parametrize("typed", ["learning_rat", "lr"])  # a misspelling; another tool's word (the study file's hints)
def test_unknown_key_names_the_key_and_the_allowed_ones(typed: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainingConfig.from_dict({typed: 0.1})
    [(key, message)] = info.value.problems
    assert key == typed
    assert "unknown key (did you mean 'learning_rate'?); expected one of: " in message


@pytest.mark.parametrize(
    ("values", "key", "fragment"),
    [
        ({"optimizer": "rmsprop"}, "optimizer", "'adam', 'adamw', 'sgd', 'lion'"),
        ({"scheduler": "exp"}, "scheduler", "'cosine'"),
        ({"learning_rate": 0}, "learning_rate", "(0, 3.4028234663852886e+38]"),
        ({"learning_rate": "fast"}, "learning_rate", "expected a number"),
        ({"max_steps": 10.5}, "max_steps", "expected an integer"),
        ({"batch_size": True}, "batch_size", "expected an integer"),
        ({"momentum": 1.0}, "momentum", "[0, 1)"),
        ({"gradient_clip_norm": -1.0}, "gradient_clip_norm", "(0, inf]"),
        ({"device": "gpu"}, "device", "'cuda:N'"),
        # Torch refuses these where the check took them: each trial of a study failed instead (review).
        ({"device": "cuda:00"}, "device", "'cuda:N'"),
        ({"device": "cuda:\u0663"}, "device", "'cuda:N'"),
        ({"device": "cuda:99999999999999999999"}, "device", "'cuda:N'"),
        ({"mixed_precision": True}, "mixed_precision", "'auto', 'off', 'bf16', 'fp16'"),
        ({"model": [1, 2]}, "model", "expected a mapping"),
        ({"task": "not a task!"}, "task", "package.module:function"),
        ({"warmup_steps": 20, "max_steps": 10}, "warmup_steps", "at most max_steps"),
        ({"nesterov": True, "optimizer": "adam"}, "nesterov", "optimizer 'sgd'"),
        ({"compile_mode": "reduce-overhead"}, "compile_mode", "needs compile: true"),
        ({"compile": True, "compile_mode": "graphs"}, "compile_mode", "'reduce-overhead'"),
        ({"seed": 2**32}, "seed", "[0, 4294967295]"),  # 2**32 trained as seed 0: 32-bit generators
        ({"loader_workers": 100_000}, "loader_workers", "[0, 512]"),  # forked until killed
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(values: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainingConfig.from_dict(values)
    assert [k for k, _ in info.value.problems] == [key]
    assert fragment in info.value.problems[0][1]


def test_every_problem_is_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        TrainingConfig.from_dict({"optimizer": "rmsprop", "batch_size": 0, "bogus": 1})
    assert sorted(k for k, _ in info.value.problems) == ["batch_size", "bogus", "optimizer"]


def test_yaml_style_exponent_strings_are_read_as_numbers() -> None:
    # YAML 1.1 reads `1e-3` (no dot) as a string; a learning rate written that way must still work.
    assert TrainingConfig.from_dict({"learning_rate": "1e-3"}).learning_rate == pytest.approx(1e-3)
    assert TrainingConfig.from_dict({"learning_rate": 1}).learning_rate == 1.0


def test_dotted_keys_nest_into_mappings() -> None:
    config = TrainingConfig.from_dict({"model.hidden": 32, "model": {"depth": 3}, "task_args.val_fraction": 0.3})
    assert config.model == {"hidden": 32, "depth": 3}
    assert config.task_args == {"val_fraction": 0.3}
    assert nest(flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3})) == {"a": {"b": 1, "c": {"d": 2}}, "e": 3}


def test_replace_merges_dotted_overrides() -> None:
    config = TrainingConfig.from_dict({"model": {"hidden": 32, "depth": 1}})
    changed = config.replace({"model.hidden": 64, "learning_rate": 0.01})
    assert changed.model == {"hidden": 64, "depth": 1}
    assert changed.learning_rate == 0.01
    assert config.model == {"hidden": 32, "depth": 1}  # the original is untouched


def test_is_key_knows_free_form_mappings() -> None:
    assert TrainingConfig.is_key("learning_rate")
    assert TrainingConfig.is_key("model.anything")
    assert not TrainingConfig.is_key("learning_rate.x")
    assert not TrainingConfig.is_key("lr")
