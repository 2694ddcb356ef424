"""portable_config: what Ray shards receive of a model's transformers config (raypaged/model/portable_config.py)."""

from __future__ import annotations

import pickle

import pytest
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    LlavaConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
)

from raypaged.model.portable_config import ShardModelConfig, _class_names, portable_config

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(
            **SHAPE,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        Qwen3Config(**SHAPE, head_dim=16),
        MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
    ],
    ids=["llama3-rope", "qwen3", "mixtral"],
)
def test_a_config_without_code_of_its_own_travels_on_the_base_class_with_every_value(config):
    config.raypaged_marker = "set after loading"  # as EngineConfig sets its own attributes
    portable = portable_config(config)
    assert type(portable) is ShardModelConfig and isinstance(portable, PretrainedConfig)
    names = set(vars(config)) | _class_names(type(config))
    assert {"model_type", "hidden_size", "rope_parameters", "raypaged_marker"} <= names
    assert {name: getattr(portable, name) for name in names} == {name: getattr(config, name) for name in names}
    assert portable.to_dict() == config.to_dict()
    for alias, name in type(config).attribute_map.items():  # Mixtral's num_experts reads num_local_experts
        assert getattr(portable, alias) == getattr(config, name) == getattr(config, alias)
    assert portable.get_text_config() is portable
    again = pickle.loads(pickle.dumps(portable))
    assert type(again) is ShardModelConfig and again.to_dict() == config.to_dict()
    assert config.model_type == type(config).model_type  # the original is untouched


def test_configs_whose_class_has_code_or_sub_configs_travel_as_they_are():
    gemma, phi3 = Gemma3TextConfig(**SHAPE), Phi3Config(**SHAPE)  # their own rope conversions (and to_dict)
    llava = LlavaConfig(text_config=LlamaConfig(**SHAPE))  # sub-configs
    for config in (gemma, phi3, llava):
        assert portable_config(config) is config
