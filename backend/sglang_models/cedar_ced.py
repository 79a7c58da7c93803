"""Entry point for SGLang's model registry: ``architectures: ["CedarForCausalLM"]``."""

from cedar.backend.serving.served_model import CedarForCausalLM

EntryClass = CedarForCausalLM
