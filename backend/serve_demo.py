"""``cedar serve-demo``: serve the shipped model with SGLang and send it a few raw requests, a
repeated prefix among them, printing each answer with its cached / replayed token counts (the
agent demo that ``make demo`` runs is ``cedar.agents.demo``). ``ensure_model`` builds the
random-init model where it is missing."""

from __future__ import annotations

import json
from pathlib import Path

from .geometries import geometry
from .memory import memory_report
from .serving.launch import ServeConfig
from .serving.process import ServerProcess, free_port

SYSTEM = ("You are a coding agent. Tools: list_files(path), read_file(path), run(cmd). "
          "Answer with one tool call as JSON. ") * 6  # a long shared system prompt (> W tokens)


def ensure_model(model_dir: Path) -> None:
    """A model folder without weights: ``cedar-tiny`` is built (random init); anything else,
    e.g. the shipped ``cedar-agent``, is an error naming the folder."""
    model_dir = Path(model_dir)
    if not (model_dir / "model.safetensors").is_file():
        from .model_io import init_model_dir

        if model_dir.name != "cedar-tiny":
            raise FileNotFoundError(f"no model.safetensors in {model_dir} (the shipped model is "
                                    "models/cedar-agent; `cedar init-model` writes a random one)")
        print(f"[demo] building the random-init cedar-tiny model in {model_dir}")
        init_model_dir("cedar-tiny", model_dir)


def run_demo(model_dir: Path, max_new_tokens: int = 12) -> int:
    ensure_model(model_dir)
    print(f"[demo] memory (v41-flash): {json.dumps(memory_report(geometry('v41-flash')).to_json_dict())}")
    cfg = ServeConfig(model=str(model_dir), port=free_port())
    print(f"[demo] starting SGLang with {model_dir} on {cfg.port} (about 20 s)")
    with ServerProcess(cfg) as srv:
        state = srv.cedar_state()
        print(f"[demo] server budgets {state['budget_bytes_per_token']} B/token for "
              f"{state['integrity']['tokens']['total']} tokens; SWA {state['swa_bytes_per_request']} B/request")
        questions = ["List the files in the repo.", "Read README.md.", "List the files in the repo."]
        for q in questions:
            status, out = srv.post("/generate", {
                "text": f"<|bos|><|system|>{SYSTEM}<|end|><|user|>{q}<|end|><|assistant|>",
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
            meta = out.get("meta_info", {})
            print(f"[demo] {q!r}: prompt {meta.get('prompt_tokens')} tokens, cached {meta.get('cached_tokens')}, "
                  f"replayed {meta.get('replayed_tokens')} -> {out.get('text', out)!r}")
        # a second turn of the first session: its prompt + its answer + new text continues the
        # finished request's exact window state (restored snapshot, nothing replayed)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        turn1 = tok.encode(f"<|bos|><|system|>{SYSTEM}<|end|><|user|>Which tests exist?<|end|><|assistant|>").ids
        status, out1 = srv.post("/generate", {"input_ids": turn1, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
        turn2 = turn1 + out1["output_ids"] + tok.encode("<|end|><|user|>Now read the first file.<|end|><|assistant|>").ids
        status, out2 = srv.post("/generate", {"input_ids": turn2, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}})
        meta = out2.get("meta_info", {})
        print(f"[demo] session turn 2: prompt {meta.get('prompt_tokens')} tokens, cached {meta.get('cached_tokens')}, "
              f"restored {meta.get('restored_tokens')}, replayed {meta.get('replayed_tokens')} -> {out2.get('text')!r}")
        status, out = srv.post("/v1/chat/completions", {
            "model": str(model_dir), "max_tokens": max_new_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]})
        usage = out.get("usage", {})
        print(f"[demo] /v1/chat/completions: {out['choices'][0]['message']['content']!r} (usage {usage})")
        state = srv.cedar_state()
        print(f"[demo] replayed tokens in total: {state['replayed_tokens_total']}; "
              f"pool integrity ok: {state['integrity']['tokens_ok']}")
    print("[demo] server stopped")
    return 0
