"""Cedar's tokenizer: a small byte-level BPE built offline from a built-in corpus.

Contract of a tokenizer directory written by `build_tokenizer` (loadable by
`transformers.AutoTokenizer.from_pretrained(dir)` and therefore by SGLang):

- `tokenizer.json`: byte-level BPE. Every byte has a token, so any UTF-8 text round-trips
  (`decode(encode(s)) == s`); there is no unknown token.
- Special tokens take ids `0 .. len(SPECIAL_TOKENS) - 1` in the order of `SPECIAL_TOKENS`; each
  encodes to its one id wherever its text appears (it is matched before BPE runs).
- `encode` adds no BOS/EOS (the chat template writes `<|bos|>` itself, so adding one on encode
  would double it when SGLang tokenizes a rendered chat prompt).
- `tokenizer_config.json`: `eos_token` is `<|end|>` (what ends an assistant turn); generation must
  stop on `<|end|>` *and* `<|eos|>`, see `generation_eos_token_ids` for the list a model config or
  `generation_config.json` should carry.
- Chat template (`chat_template.CHAT_TEMPLATE`): `<|bos|>` then `{role marker}{content}<|end|>` per
  message, tools and tool calls in SGLang's `hermes` markup; `add_generation_prompt` appends
  `<|assistant|>`.

Building is deterministic: two builds with the same arguments write byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from .chat_template import CHAT_TEMPLATE

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
END = "<|end|>"
ROLE_MARKERS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
# NOTE: the order fixes the ids (0..7); the model config and tests rely on it.
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_MARKERS.values(), END)

MODEL_MAX_LENGTH = 8192
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what build_tokenizer writes
# NOTE: the tool-call markup of `chat_template` (TOOL_CALL_BEGIN / END) as whole tokens
MARKUP_TOKENS = ("<tool_call>", "</tool_call>")


def build_tokenizer(out_dir: Path, vocab_size: int = 512, corpus: list[str] | None = None,
                    markup_tokens: bool = False, model_max_length: int = MODEL_MAX_LENGTH) -> None:
    """Train the byte-level BPE on `corpus` (default `builtin_corpus()`) and write the tokenizer
    files to `out_dir`.

    Writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` (creating
    `out_dir` if needed; existing files are overwritten). `vocab_size` counts specials, the 256
    byte tokens and the merges, so it must exceed `len(SPECIAL_TOKENS) + 256`. `markup_tokens`
    adds `MARKUP_TOKENS` (`<tool_call>`, `</tool_call>`) as single, non-special tokens (kept in
    decoded text, so SGLang's tool-call parser still sees them).
    """
    min_size = len(SPECIAL_TOKENS) + 256 + 1
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges (need >= {min_size})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_bpe(corpus or builtin_corpus(), vocab_size - (len(MARKUP_TOKENS) if markup_tokens else 0))
    if markup_tokens:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(model_max_length))
    _write_json(out_dir / "special_tokens_map.json", _special_tokens_map())


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Map each of `SPECIAL_TOKENS` to its id, read from `tokenizer_dir/tokenizer.json`.

    Raises ValueError if a special token is missing or is not a single id.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        encoded = tokenizer.encode(token, add_special_tokens=False).ids
        if token_id is None or encoded != [token_id]:
            raise ValueError(f"special token {token!r} is not a single id in {tokenizer_dir}")
        ids[token] = token_id
    return ids


def generation_eos_token_ids(tokenizer_dir: Path) -> list[int]:
    """Ids that end generation, `[<|end|>, <|eos|>]`: for `eos_token_id` in the model config."""
    ids = special_token_ids(tokenizer_dir)
    return [ids[END], ids[EOS]]


def _train_bpe(lines: list[str], vocab_size: int):
    """Train a byte-level BPE on `lines`; returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # NOTE: add_prefix_space=False so that encode/decode is the identity on any string.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # NOTE: the full byte alphabet, not just the bytes seen in the corpus, so unseen
        # characters (any unicode) still encode as their UTF-8 bytes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tokenizer


def _tokenizer_config(model_max_length: int) -> dict:
    """The `tokenizer_config.json` contents (transformers' PreTrainedTokenizerFast)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [EOS, *ROLE_MARKERS.values()],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict:
    return {
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "additional_special_tokens": [EOS, *ROLE_MARKERS.values()],
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Built-in corpus. Pure functions of fixed word lists (no randomness), so training is reproducible.
# ---------------------------------------------------------------------------------------------

_NOUNS = ("cache", "request", "token", "window", "layer", "model", "server", "file", "query",
          "result", "agent", "prefix", "batch", "tensor", "config")
_VERBS = ("reads", "writes", "checks", "returns", "stores", "skips", "finds", "builds", "sends")
_ADJS = ("small", "shared", "new", "cached", "long", "empty", "valid", "last", "next")
_TOOLS = ("search", "read_file", "write_file", "run_tests", "list_dir", "get_weather", "calc")
_ARGS = ("query", "path", "city", "expression", "pattern", "limit")
_VALUES = ("cedar tiny", "src/main.py", "Paris", "2 + 3 * 7", "*.json", "10", "README.md",
           "Tokyo", "sum(range(100))", "tests/")


def builtin_corpus() -> list[str]:
    """A few hundred lines of prose, agent tool calls, JSON, Python and numbers (deterministic)."""
    return [*_prose_lines(), *_tool_call_lines(), *_json_lines(), *_python_lines(),
            *_number_lines()]


def _prose_lines() -> list[str]:
    lines = []
    for i, noun in enumerate(_NOUNS):
        for j, verb in enumerate(_VERBS):
            adj = _ADJS[(i + j) % len(_ADJS)]
            other = _NOUNS[(i * 3 + j + 1) % len(_NOUNS)]
            lines.append(f"The {adj} {noun} {verb} the {other} before the {_NOUNS[j]} is ready.")
    lines += [
        "You are a helpful assistant. Answer briefly and use tools when needed.",
        "What is the weather in Paris today? It is sunny, 21 degrees.",
        "Please read the file and tell me what the function does.",
        "I could not find that file. Did you mean a different path?",
        "Sure! Here is a summary of the changes: three files were updated.",
        "Thanks, that works. Can you also add a test for the edge case?",
    ]
    return lines


def _tool_call_lines() -> list[str]:
    lines = []
    for i, tool in enumerate(_TOOLS):
        for j in range(6):
            arg = _ARGS[(i + j) % len(_ARGS)]
            value = _VALUES[(i * 2 + j) % len(_VALUES)]
            call = {"name": tool, "arguments": {arg: value}}
            lines.append(f"<tool_call>{json.dumps(call)}</tool_call>")
            lines.append(f'{{"tool": "{tool}", "status": "ok", "id": "call_{i}{j}"}}')
    return lines


def _json_lines() -> list[str]:
    lines = []
    for i in range(40):
        record = {
            "id": i,
            "name": _NOUNS[i % len(_NOUNS)],
            "size": (i * 37) % 1000,
            "ok": i % 3 != 0,
            "tags": [_ADJS[i % len(_ADJS)], _ADJS[(i + 4) % len(_ADJS)]],
            "score": round(i / 7, 3),
            "parent": None if i % 5 == 0 else i - 1,
        }
        lines.append(json.dumps(record))
        lines.append(json.dumps(record, indent=2))
    return lines


def _python_lines() -> list[str]:
    lines = []
    for i, noun in enumerate(_NOUNS):
        verb = _VERBS[i % len(_VERBS)].rstrip("s")
        lines += [
            f"def {verb}_{noun}(self, {noun}_id: int, limit: int = {i + 1}) -> list[str]:",
            f'    """{verb.capitalize()} the {noun} with the given id."""',
            f"    if {noun}_id < 0:",
            f'        raise ValueError(f"bad {noun} id: {{{noun}_id}}")',
            "    for i in range(limit):",
            f"        self.{noun}s[i] = self.{noun}s.get(i, 0) + {i}",
            f"    return [str(x) for x in self.{noun}s.values()]",
            f"import torch\nx = torch.zeros({i + 1}, {2 * i + 3}, dtype=torch.float32)",
            f"assert x.shape == ({i + 1}, {2 * i + 3}), x.shape  # {noun}",
        ]
    return lines


def _number_lines() -> list[str]:
    lines = []
    for a in range(1, 60, 3):
        b = (a * 7) % 50
        lines.append(f"{a} + {b} = {a + b}; {a} * {b} = {a * b}; {a * 1000 + b} / 4 = "
                     f"{(a * 1000 + b) / 4}")
        lines.append(f"2024-{a % 12 + 1:02d}-{b % 28 + 1:02d} {a % 24:02d}:{b:02d}:00 port {8000 + a}")
    return lines
