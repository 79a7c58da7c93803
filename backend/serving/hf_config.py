"""The transformers config class for ``model_type: cedar_ced`` (registered with AutoConfig by
the SGLang plugin, in every SGLang process, and by :func:`load_tokenizer` in any other)."""

from __future__ import annotations

from pathlib import Path

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


def load_tokenizer(model_dir: str | Path):
    """The HF tokenizer of a Cedar model folder (``AutoTokenizer``), in any process.

    NOTE: AutoTokenizer reads the folder's config.json; with ``cedar_ced`` unknown to AutoConfig
    it reads it as a bare ``PretrainedConfig`` and warns "You are using a model of type
    `cedar_ced` to instantiate a model of type ``" (a client of a server, ``cedar generate``).
    Registering the config class first is the fix."""
    from transformers import AutoTokenizer

    register_auto_config()
    return AutoTokenizer.from_pretrained(str(model_dir))
