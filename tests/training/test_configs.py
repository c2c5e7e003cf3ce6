"""Every YAML in configs/ loads into its dataclass (torchtune's test_configs), every key is commented, the header
gives the launch command, and bad keys or values are clear errors before anything runs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from selfspec.training import apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
# Recipe configs name their recipe in the header (train/<name>.py --config ...); other YAMLs (ablation grids, ...)
# belong to their own commands and tests.
RECIPE_CONFIGS = [p for p in CONFIGS if p.parent.name != "accelerate"
                  and ("train/" in p.read_text().split("\n\n")[0] or p.parent.name == "medusa")]
ACCELERATE_CONFIGS = [p for p in CONFIGS if p.parent.name == "accelerate"]
RECIPES = {"train/medusa.py": "medusa.recipe", "train/early_exit.py": "early_exit.recipe", "train/eagle.py": "eagle.recipe"}


def recipe_module(script: str):
    """The recipe module a launcher in train/ starts (``train/medusa.py`` -> ``medusa.recipe``)."""
    return importlib.import_module(RECIPES[script])


def launch_script(path: Path) -> str:
    """The recipe named by the config's header: ``... train/<name>.py --config configs/<this file> ...``."""
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    match = re.search(r"(train/\w+\.py) --config (\S+)", header)
    assert match, f"{path}: the header must give the launch command (train/<recipe>.py --config {path.relative_to(ROOT)})"
    assert match.group(2) == str(path.relative_to(ROOT)), f"{path}: the header launches {match.group(2)}"
    return match.group(1)


def test_there_are_configs():
    assert {p.parent.name for p in CONFIGS} >= {"medusa", "accelerate"}
    assert {p.name for p in RECIPE_CONFIGS if p.parent.name == "medusa"} >= {"tiny.yaml", "smollm2-135m.yaml",
                                                                             "smollm2-135m-medusa2.yaml"}
    assert len(ACCELERATE_CONFIGS) >= 4


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_config_loads_into_its_dataclass(path):
    module = recipe_module(launch_script(path))
    config_class = recipe_config_class(module)
    assert isinstance(load_config(config_class, path), config_class)


def recipe_config_class(module):
    """``RecipeConfig``, or the one dataclass of the recipe named ``*RecipeConfig``."""
    if hasattr(module, "RecipeConfig"):
        return module.RecipeConfig
    (found,) = {v for k, v in vars(module).items() if k.endswith("RecipeConfig") and isinstance(v, type)}
    return found


@pytest.mark.parametrize("path", RECIPE_CONFIGS + ACCELERATE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_key_is_commented(path):
    uncommented = [line for line in path.read_text().splitlines()  # a section header ("optim:") may go without
                   if line.strip() and not line.lstrip().startswith("#") and "#" not in line
                   and not line.rstrip().endswith(":")]
    assert not uncommented, f"{path}: keys without a comment: {uncommented}"


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 1
    assert "accelerate launch --config_file " + str(path.relative_to(ROOT)) in path.read_text()


# ---------------------------------------------------------------- overrides and errors

@pytest.fixture(scope="module")
def medusa():
    return recipe_module("train/medusa.py")


TINY = ROOT / "configs/medusa/tiny.yaml"


def test_dotted_overrides_parse_as_yaml(medusa):
    config = load_config(medusa.RecipeConfig, TINY, ["optim.lr=0.5", "heads.num_heads=2", "data.source=null",
                                                     "lora.target_modules=[q_proj]", "method=medusa2"])
    assert config.optim.lr == 0.5 and config.heads.num_heads == 2 and config.data.source is None
    assert config.lora.target_modules == ["q_proj"] and config.method == "medusa2"


def test_overrides_do_not_touch_the_input():
    data = {"a": {"b": 1}}
    assert apply_overrides(data, ["a.b=2", "c=x"]) == {"a": {"b": 2}, "c": "x"}
    assert data == {"a": {"b": 1}}


@pytest.mark.parametrize("override, name", [("optimm.lr=1", "optimm"), ("optim.learning_rate=1", "optim.learning_rate"),
                                            ("bogus=1", "bogus")])
def test_unknown_key_is_a_clear_error(medusa, override, name):
    with pytest.raises(ValueError, match=rf"unknown config key\(s\) \['{re.escape(name)}'\]; known keys"):
        load_config(medusa.RecipeConfig, TINY, [override])


def test_unknown_key_in_a_file_is_a_clear_error(medusa, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load(TINY.read_text()), "num_epochs": 3}))
    with pytest.raises(ValueError, match="num_epochs"):
        load_config(medusa.RecipeConfig, bad)


@pytest.mark.parametrize("override, message", [
    ("heads.num_heads=0", "num_heads must be an integer >= 1"),
    ("heads.num_heads=-2", "num_heads must be an integer >= 1"),
    ("method=medusa3", "method must be medusa1 or medusa2"),
    ("data.format=csv", "data.format 'csv' is not one of"),
    ("optim.schedule=linear", "optim.schedule must be cosine or constant"),
    ("optim.base_linear_backend=mkl", "optim.base_linear_backend must be auto, stock or onednn"),
])
def test_bad_values_are_clear_errors(medusa, override, message):
    with pytest.raises(ValueError, match=message):
        load_config(medusa.RecipeConfig, TINY, [override])


def test_override_without_equals_and_missing_file(medusa):
    with pytest.raises(ValueError, match="key=value"):
        load_config(medusa.RecipeConfig, TINY, ["optim.lr"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(medusa.RecipeConfig, ROOT / "configs/medusa/nope.yaml")


def test_unquoted_no_means_no_mixed_precision(medusa, tmp_path):
    # YAML 1.1 reads an unquoted `no` as false; accelerate's configs and ours document `no`, so both spellings work.
    assert load_config(medusa.RecipeConfig, TINY, ["optim.mixed_precision=no"]).optim.mixed_precision == "no"
    assert load_config(medusa.RecipeConfig, TINY, ["optim.mixed_precision='no'"]).optim.mixed_precision == "no"
    in_file = tmp_path / "no.yaml"
    in_file.write_text(TINY.read_text().replace("\noptim:\n", "\noptim:\n  mixed_precision: no\n", 1))
    assert "mixed_precision: no" in in_file.read_text()
    assert load_config(medusa.RecipeConfig, in_file).optim.mixed_precision == "no"
    with pytest.raises(ValueError, match="must be no, bf16, fp16"):
        load_config(medusa.RecipeConfig, TINY, ["optim.mixed_precision=true"])
    # Any other string key given a bare yes/no/on/off says how to quote it.
    with pytest.raises(ValueError, match=r"data.format: expected a string, got False \(YAML reads an unquoted"):
        load_config(medusa.RecipeConfig, TINY, ["data.format=no"])
