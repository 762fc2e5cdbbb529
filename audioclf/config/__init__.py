"""Typed run configuration: YAML file + dotted command-line overrides.

Every section is a dataclass; each field carries a one-line comment (the generated reference,
docs/configuration.md, is made of them). Unknown keys and wrong types are rejected with one
message naming the key and listing the valid keys of its section.

    cfg = load_config("configs/demo_cnn.yaml", ["train.epochs=3", "sampler.m=4"])

base: the error and the checks; inputs: data, sampler, features, clips, augmentation sections;
sections: model, loss, optimizer, train, dist, eval, checkpoint and Config; loading: YAML,
overrides, coercion, earlier layouts; reference: the generated reference.
"""

from audioclf.config.base import ConfigError, choices, differences
from audioclf.config.inputs import (
    AugmentConfig,
    ClipsConfig,
    DataConfig,
    FeaturesConfig,
    SpecAugmentConfig,
)
from audioclf.config.loading import (
    config_from_dict,
    load_config,
    save_config,
    to_dict,
)
from audioclf.config.reference import (
    readme_with_reference,
)
from audioclf.config.sections import (
    CNNConfig,
    Config,
    ConformerConfig,
    ECAPAConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ResNetConfig,
    TrainConfig,
    UnlabelledConfig,
    architecture,
)

__all__ = [
    "differences",
    "AugmentConfig",
    "CNNConfig",
    "ClipsConfig",
    "Config",
    "ConfigError",
    "ConformerConfig",
    "ECAPAConfig",
    "DataConfig",
    "FeaturesConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ResNetConfig",
    "SpecAugmentConfig",
    "TrainConfig",
    "UnlabelledConfig",
    "architecture",
    "choices",
    "config_from_dict",
    "load_config",
    "readme_with_reference",
    "save_config",
    "to_dict",
]
