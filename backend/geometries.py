"""Named geometries: ``v41-flash`` (the reference layout of SPEC section 1, for byte accounting),
``cedar-tiny`` (the random-init test model, sized for 2 CPU cores with every role present) and
``cedar-agent`` (the trained, shipped model: cedar-tiny's roles, wider)."""

from __future__ import annotations

from dataclasses import replace

from .config import CEDConfig


def v41_flash() -> CEDConfig:
    """DeepSeek-V4.1-Flash's attention layout (dense MLP stands in for MoE; never instantiated)."""
    ratios = (0, 0) + (2,) * 18 + (1,) * 20
    return CEDConfig(
        name="v41-flash", vocab_size=129280, hidden_size=5120, intermediate_size=2048,
        num_hidden_layers=40, num_attention_heads=64, kv_latent_dim=512, rope_dim=64,
        index_head_dim=128, index_num_heads=32, index_topk=512, compress_ratios=ratios,
        kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        sliding_window=128, page_size=256, max_position_embeddings=1048576,
    )


def cedar_tiny(vocab_size: int = 512, bos: int = 0, eos: tuple[int, ...] = (1,), pad: int = 2) -> CEDConfig:
    """8 layers. Encoder 0-3: SWA-only, Full r2, Reuse, Reuse. Decoder 4-7: Full r1 (the decoder
    source), Reuse, Reindex, Reuse. W = 128 as on V4.1 so replay is exercised at real lengths;
    top-k 16 so sparse selection bites from 32 tokens (r2) / 16 tokens (r1) on."""
    return CEDConfig(
        name="cedar-tiny", vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=4, kv_latent_dim=64, rope_dim=16,
        index_head_dim=32, index_num_heads=2, index_topk=16, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1),
        kv_source_layer_ids=(1, 4), index_source_layer_ids=(1, 4, 6), sliding_window=128,
        page_size=2, max_position_embeddings=16384, bos_token_id=bos, eos_token_ids=eos,
        pad_token_id=pad,
    )


def cedar_agent(vocab_size: int = 2048, bos: int = 0, eos: tuple[int, ...] = (1,), pad: int = 2) -> CEDConfig:
    """The trained, shipped model: cedar-tiny's layer roles at hidden 256 and a 2,048-token
    vocabulary; top-k 32 so a recall far outside the window has room among the selected entries."""
    return replace(cedar_tiny(vocab_size, bos, eos, pad), name="cedar-agent", hidden_size=256,
                   intermediate_size=512, index_topk=32)


GEOMETRIES = {"v41-flash": v41_flash, "cedar-tiny": cedar_tiny, "cedar-agent": cedar_agent}


def geometry(name: str) -> CEDConfig:
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; choose one of {sorted(GEOMETRIES)}")
    return GEOMETRIES[name]()
