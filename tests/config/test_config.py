"""Config: YAML + dotted overrides, and every rejection path."""

from pathlib import Path

import pytest
import yaml

from audioclf.config import Config, ConfigError, config_from_dict, load_config, save_config, to_dict
from tests.helpers import ROOT

CONFIGS = sorted(ROOT.joinpath("configs").glob("*.yaml"))


def write(tmp_path, data) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_yaml_then_overrides(tmp_path):
    path = write(tmp_path, {"train": {"epochs": 5, "name": "x"}, "model": {"name": "conformer"}})
    cfg = load_config(
        path,
        [
            "train.epochs=3",
            "sampler.m=8",
            "sampler.batch_size=64",
            "model.conformer.num_layers=2",
            "features.f_max=7600",
        ],
    )
    assert cfg.train.epochs == 3 and cfg.train.name == "x"
    assert cfg.model.name == "conformer" and cfg.model.conformer.num_layers == 2
    assert (cfg.sampler.m, cfg.sampler.batch_size) == (8, 64)
    assert cfg.features.f_max == 7600.0 and isinstance(cfg.features.f_max, float)


def test_defaults_without_file():
    cfg = load_config(None, [])
    assert cfg == Config()


def test_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML parses 5e-4 as a string; users write learning rates that way.
    cfg = load_config(write(tmp_path, {"optim": {"lr": "5e-4"}}), ["optim.min_lr=1e-6"])
    assert cfg.optim.lr == 5e-4 and cfg.optim.min_lr == 1e-6
    with pytest.raises(ConfigError, match="optim.lr='fast' has the wrong type: expected float"):
        load_config(None, ["optim.lr=fast"])


def test_int_accepted_for_float_and_null_for_optional():
    cfg = load_config(None, ["optim.lr=1", "features.f_max=null"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.features.f_max is None


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["train.epochz=3"],
            r"unknown config key train\.epochz.*valid keys: name, runs_dir, epochs",
        ),
        (["nope.x=1"], r"unknown config key nope.*valid keys: data, sampler"),
        (["model.conformer.layers=2"], r"unknown config key model\.conformer\.layers.*num_layers"),
        (["train.epochs=abc"], r"train\.epochs='abc' has the wrong type: expected int, got str"),
        (["train.epochs=1.5"], r"train\.epochs=1\.5 has the wrong type: expected int"),
        (["train.deterministic=3"], r"train\.deterministic=3 has the wrong type: expected bool"),
        (["optim.lr=true"], r"optim\.lr=True has the wrong type: expected float"),
        (
            ["model.name=rnn"],
            r"model\.name='rnn' is not a valid choice: use one of 'cnn', 'conformer'",
        ),
        (["train.opt_level=O4"], r"train\.opt_level='O4' has the wrong type"),
        (
            ["sampler.m=3"],
            r"sampler\.batch_size=32 is invalid: expected a multiple of sampler\.m=3",
        ),
        (["sampler.m=1", "sampler.batch_size=4"], r"sampler\.m=1.*triplet loss needs positives"),
        (["train.epochs=0"], r"train\.epochs=0 is invalid"),
        (["data.val_ratio=1.5"], r"data\.val_ratio=1\.5 is invalid"),
        (["model.conformer.d_model=30"], r"d_model=30.*multiple of model\.conformer\.num_heads"),
        (["train.epochs"], r"not of the form section\.key=value"),
        (["train..epochs=1"], r"empty key"),
        (["model=3"], r"section model must be a mapping"),
        (
            ["train.compile=true", "dist.strategy=dp"],
            r"^config key train\.compile=True is invalid: expected false with dist\.strategy=dp "
            r"\(DataParallel.*set train\.compile=false, or compile under DDP[^\n]*$",
        ),
    ],
)
def test_rejections(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = write(tmp_path, {"optim": {"learning_rate": 0.1}})
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown config key optim\.learning_rate"):
        load_config(path)


@pytest.mark.parametrize(("key", "used"), [("neighbours", 512), ("align_weight", 1.0)])
def test_a_retired_key_is_dropped_from_checkpoints_and_refused_when_asked_for(tmp_path, key, used):
    # checkpoints of the commits that had the key store it: at "off", or at the run's value
    for value in (0, used):
        stored = to_dict(Config())
        stored["unlabelled"][key] = value
        assert config_from_dict(stored) == Config()
    path = write(tmp_path, {"unlabelled": {key: 0}})  # a saved config.yaml of those commits
    with pytest.warns(UserWarning, match=rf"unlabelled\.{key}=0 dropped"):
        assert load_config(path) == Config()
    with pytest.raises(
        ConfigError, match=rf"overrides: unlabelled\.{key}={used}: audioclf no longer"
    ):
        load_config(None, [f"unlabelled.{key}={used}"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["model.name=conformer", "train.opt_level=O1"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert config_from_dict(to_dict(cfg)) == cfg
    assert not list(tmp_path.glob("*.tmp"))


def test_the_configuration_reference_is_current():
    from audioclf.config import readme_with_reference

    page = ROOT / "docs" / "configuration.md"
    text = page.read_text()
    assert text == readme_with_reference(text), (
        "docs/configuration.md is stale: run python -m audioclf.config --update-readme"
    )


@pytest.mark.parametrize(
    "override",
    ["optim.lr=inf", "optim.lr=.nan", "optim.max_grad_norm=-.inf", "optim.weight_decay=1e999"],
)
def test_non_finite_numbers_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.* is invalid: expected a finite number"):
        load_config(None, [override])
