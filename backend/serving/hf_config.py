"""The transformers config class for ``model_type: cedar_ced`` (registered with AutoConfig by
the SGLang plugin, in every SGLang process)."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import MODEL_TYPE, CEDConfig


class CedarHFConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, **kwargs):
        kwargs.setdefault("num_key_value_heads", 1)
        if "kv_latent_dim" in kwargs:
            kwargs.setdefault("head_dim", kwargs["kv_latent_dim"])
        super().__init__(**kwargs)



def ced_config_of(hf_config) -> CEDConfig:
    """The CEDConfig of an HF config object (SGLang hands the model and its hooks one)."""
    return CEDConfig.from_hf_dict(hf_config.to_dict())


def register_auto_config() -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.register(MODEL_TYPE, CedarHFConfig)
    except ValueError:  # already registered in this process
        pass
