"""CEDConfig: the geometry of a causal encoder-decoder model, read from / written to config.json.

A frozen dataclass validated in ``__post_init__``; every derived fact (each layer's role, which
source a layer reads, where the decoder starts) is a property, so a config can never disagree
with itself. Roles (SPEC section 1):

- ``swa``: ``compress_ratio == 0``; the layer attends its sliding window only.
- ``full``: a KV source (in ``kv_source_layer_ids``); owns a compressor and index keys, computes
  its own top-k.
- ``reindex``: reads the nearest earlier source's global KV and index keys, computes its own top-k
  (in ``index_source_layer_ids`` but not a KV source).
- ``reuse``: reads the nearest earlier source's global KV and the nearest earlier index producer's
  top-k (cross-layer KV sharing).

The decoder's only KV source is layer ``E = L // 2`` with ratio 1; layers after it own nothing but
their window.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path


class Role(str, Enum):
    SWA = "swa"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


ARCHITECTURE = "CedarForCausalLM"
MODEL_TYPE = "cedar_ced"


@dataclass(frozen=True)
class CEDConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_latent_dim: int  # K = V shared MQA latent width (512 on V4.1-Flash)
    rope_dim: int  # RoPE is applied to the last ``rope_dim`` latent dims
    index_head_dim: int  # width of index keys / indexer queries (128 on V4.1-Flash)
    index_num_heads: int
    index_topk: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]  # Full and Reindex layers
    sliding_window: int = 128
    page_size: int = 2  # prefix-cache granularity in tokens; every ratio must divide it
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 2
    torch_dtype: str = "float32"
    # the decoder source's global entries become selectable only once their token has left the
    # window (an entry of position p from p + W on): the decoder's top-k never spends a slot on a
    # key its window attention already reads, and its indexer is distilled toward where the
    # decoder looks beyond the window (its target is the attention over selectable entries)
    decoder_global_beyond_window: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # JSON gives lists; keep the dataclass hashable and frozen
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))
        self._validate()

    # ---------------------------------------------------------------- validation
    def _validate(self) -> None:
        L = self.num_hidden_layers
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_latent_dim", "index_head_dim", "index_num_heads",
                    "index_topk", "sliding_window", "page_size", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if L % 2:
            raise ValueError(f"num_hidden_layers must be even (encoder = decoder = L/2), got {L}")
        if len(self.compress_ratios) != L:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries, expected {L}")
        if not 0 < self.rope_dim <= self.kv_latent_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and in (0, kv_latent_dim], got {self.rope_dim}")
        if self.kv_latent_dim % 32 or self.index_head_dim % 32:
            raise ValueError("kv_latent_dim and index_head_dim must be multiples of 32 (scale groups)")
        for layer, r in enumerate(self.compress_ratios):
            if r < 0:
                raise ValueError(f"layer {layer}: negative compress ratio {r}")
            if r and self.page_size % r:
                raise ValueError(f"layer {layer}: ratio {r} does not divide page_size {self.page_size}")
        for ids, what in ((self.kv_source_layer_ids, "kv_source_layer_ids"),
                          (self.index_source_layer_ids, "index_source_layer_ids")):
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < L for i in ids):
                raise ValueError(f"{what} must be sorted, unique layer ids in [0, {L}): {ids}")
            if any(self.compress_ratios[i] == 0 for i in ids):
                raise ValueError(f"{what} names a layer with compress ratio 0: {ids}")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            raise ValueError("every KV source must also be an index source (Full layers index)")
        E = self.decoder_start
        if E not in self.kv_source_layer_ids or self.compress_ratios[E] != 1:
            raise ValueError(f"the decoder source must be layer L/2 = {E} with ratio 1 "
                             f"(kv sources {self.kv_source_layer_ids}, ratio {self.compress_ratios[E]})")
        if any(s > E for s in self.kv_source_layer_ids):
            raise ValueError(f"no KV source may follow the decoder source {E}: {self.kv_source_layer_ids}")
        for layer in range(L):
            if self.compress_ratios[layer] and layer not in self.kv_source_layer_ids:
                src = self._nearest_before(self.kv_source_layer_ids, layer)
                if src is None:
                    raise ValueError(f"layer {layer} ({self.role(layer).value}) has no KV source before it")
                if self.compress_ratios[src] != self.compress_ratios[layer]:
                    raise ValueError(f"layer {layer} has ratio {self.compress_ratios[layer]} but its "
                                     f"source {src} has ratio {self.compress_ratios[src]}")
                if (layer < E) != (src < E):
                    raise ValueError(f"layer {layer} would read source {src} across the encoder/decoder cut")

    @staticmethod
    def _nearest_before(ids: tuple[int, ...], layer: int) -> int | None:
        before = [i for i in ids if i <= layer]
        return before[-1] if before else None

    # ---------------------------------------------------------------- derived roles
    @property
    def decoder_start(self) -> int:
        """E = L/2: the first decoder layer and the decoder's only KV source."""
        return self.num_hidden_layers // 2

    def role(self, layer: int) -> Role:
        if self.compress_ratios[layer] == 0:
            return Role.SWA
        if layer in self.kv_source_layer_ids:
            return Role.FULL
        if layer in self.index_source_layer_ids:
            return Role.REINDEX
        return Role.REUSE

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose global KV (and index keys) ``layer`` reads; None for SWA-only layers."""
        if self.compress_ratios[layer] == 0:
            return None
        return self._nearest_before(self.kv_source_layer_ids, layer)

    def topk_source_of(self, layer: int) -> int | None:
        """The layer whose top-k selection ``layer`` uses (itself for Full/Reindex)."""
        if self.compress_ratios[layer] == 0:
            return None
        return self._nearest_before(self.index_source_layer_ids, layer)

    def global_lag(self, source: int) -> int:
        """Positions between a source's entry becoming complete (its group's last token) and its
        becoming selectable: W for the decoder source under ``decoder_global_beyond_window``, else 0."""
        return self.sliding_window if self.decoder_global_beyond_window and source == self.decoder_start else 0

    def is_encoder(self, layer: int) -> bool:
        return layer < self.decoder_start

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(self.role(i) for i in range(self.num_hidden_layers))

    @property
    def head_dim(self) -> int:
        return self.kv_latent_dim

    # ---------------------------------------------------------------- HF config.json
    def to_hf_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        d["architectures"] = [ARCHITECTURE]
        d["model_type"] = MODEL_TYPE
        d["eos_token_id"] = list(self.eos_token_ids)
        d["num_key_value_heads"] = 1  # K = V shared MQA latent
        d["head_dim"] = self.kv_latent_dim
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "CEDConfig":
        known = {f.name for f in fields(cls)}
        args = {k: v for k, v in d.items() if k in known}
        if "eos_token_ids" not in args and "eos_token_id" in d:
            eos = d["eos_token_id"]
            args["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
        try:
            return cls(**args)
        except TypeError as e:  # missing required keys
            raise ValueError(f"config.json is missing fields for CEDConfig: {e}") from None

    def save(self, out_dir: Path) -> Path:
        path = Path(out_dir) / "config.json"
        path.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, model_dir: Path) -> "CEDConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_dir}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if d.get("model_type") not in (None, MODEL_TYPE):
            raise ValueError(f"{path}: model_type {d.get('model_type')!r} is not {MODEL_TYPE!r}")
        return cls.from_hf_dict(d)
