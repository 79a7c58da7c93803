"""Write models/cedar-agent/README.md (the model card) from the figures the commands wrote:

    python scripts/write_model_card.py MODEL_DIR EVAL_JSON FIDELITY_JSON

MODEL_DIR/training.json comes from `cedar train`, EVAL_JSON from `cedar evaluate --json`,
FIDELITY_JSON from `cedar fidelity --json`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cedar.drivers.fidelity import table_markdown


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def made_text(u: dict) -> str:
    """The unconstrained calls made (a turn's calls may come one request at a time) and why the
    rest are not valid; empty for an evaluation written before these were counted."""
    if "made" not in u:
        return ""
    why = ", ".join(f"{n} {reason}" for reason, n in u["invalid"].items() if n)
    return (f" A turn runs as a client loop runs it (its calls may come one request at a time): "
            f"{u['made']} calls made, {pct(u['valid_of_made'])} of them valid; "
            f"{u['turns_in_one_reply']}/{u['turns']} turns made all their calls in one reply"
            + (f"; not valid: {why}" if why else "") + ".")


def gold_recall_distances(model_dir: Path, n: int) -> dict:
    """Token distance from the value's first appearance to the answer, in the scripted sessions."""
    from tokenizers import Tokenizer

    from cedar.training.corpus.build import make_tasks, run_scripted

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    d = []
    for task in make_tasks(0, "heldout", {"recall": n}):
        text, value = run_scripted(task)[0], task.expect["answer"]
        d.append(len(tok.encode(text[text.find(value):text.rfind(value)]).ids))
    d.sort()
    return {"n": len(d), "min": d[0], "max": d[-1], "median": d[len(d) // 2], "over": sum(x > 512 for x in d)}


def stages(tr: dict) -> list[dict]:
    """The training runs behind a model, oldest first (each warm start names the run before it)."""
    chain = []
    while tr:
        chain.append(tr)
        tr = tr.get("warm_start")
    return chain[::-1]


def stages_table(chain: list[dict]) -> str:
    rows = ["| stage | command | steps | tokens seen | minutes | held-out loss (all / assistant) |",
            "|---|---|---|---|---|---|"]
    for i, st in enumerate(chain, 1):
        h = st.get("heldout") or {}
        minutes = f"{st['train_seconds'] / 60:.0f}" if st.get("train_seconds") is not None else "not recorded"
        loss = (f"{h['loss']:.3f} / {h['assistant_loss']:.3f}" if "loss" in h else
                "- (weights averaged, no steps)" if st.get("command", "").startswith("cedar stage average") else
                "- (not an agent-corpus stage)")
        rows.append(f"| {i} | `{st['command']}` | {st['steps']} | {st['tokens_seen']:,} | {minutes} | {loss} |")
    notes = [f"- Stage {i}: {st['note']}" for i, st in enumerate(chain, 1) if st.get("note")]
    return "\n".join(rows + ([""] + notes if notes else []))


def probes_table(probes: dict | None, beyond_window: bool = False) -> str:
    """The copy probes of the last eval (`cedar train`'s probes): repeat accuracy by gap, the
    indexer's recall of the entry holding the target (against a random choice's), values by distance."""
    if not probes:
        return "No copy probes were recorded for this run."
    gaps = list(probes["repeat"])
    rows = [f"At step {probes.get('step', '?')}:", "","| gap (tokens) | " + " | ".join(gaps) + " |", "|---|" + "---|" * len(gaps),
            "| repeat top-1 | " + " | ".join(f"{probes['repeat'][g]:.2f}" for g in gaps) + " |"]
    for layer, rec in (probes.get("recall") or {}).items():
        chance = probes.get("recall_chance", {}).get(layer, {})
        rows.append(f"| indexer recall@k, {layer} / random | " + " | ".join(
            f"{rec[g]:.2f} / {chance.get(g, float('nan')):.2f}" for g in gaps if g in rec) + " |")
    value = probes.get("value") or {}
    if value:
        rows += ["", "| value distance (tokens) | " + " | ".join(value) + " |", "|---|" + "---|" * len(value),
                 "| value tokens top-1 | " + " | ".join(f"{v:.2f}" for v in value.values()) + " |"]
        if probes.get("value_exact"):
            rows.append("| whole value right | " + " | ".join(f"{probes['value_exact'][d]:.2f}" for d in value) + " |")
        if probes.get("value_first"):
            rows.append("| value's first token right | " + " | ".join(f"{probes['value_first'][d]:.2f}" for d in value) + " |")
    if beyond_window and probes.get("recall"):
        rows += ["", "(`decoder_global_beyond_window`: the decoder layers' indexers choose only among entries whose "
                 "token has left the window, so at gaps inside it they have nothing to choose and read 0 / 0.)"]
    rows += ["", "(As the probes stood when the run ended; `cedar train --probe-only MODEL_DIR` scores a model folder "
             "with today's.)"]
    return "\n".join(rows)


def frac(n: int, d: int) -> str:
    return f"{n}/{d} ({pct(n / d) if d else '-'})"


def evaluation_tables(splits: dict) -> str:
    """`cedar evaluate`'s splits side by side: task success per family, function calls per call,
    the OpenAI-API loops; each split's note (e.g. that its templates are not held out) below."""
    names = list(splits)
    head = "| | " + " | ".join(names) + " |\n|---|" + "---|" * len(names)
    kinds = [k for k in dict.fromkeys(k for r in splits.values() for k in r.get("per_kind", {}))]
    rows = []
    for k in kinds:
        cells = []
        for r in splits.values():
            v = r.get("per_kind", {}).get(k)
            cells.append(frac(v["ok"], v["tasks"]) if v else "-")
        rows.append(f"| {k}: solved | " + " | ".join(cells) + " |")
        if k == "coding":
            rows.append("| coding: fixed line present (not counted) | " + " | ".join(
                frac(r["per_kind"][k].get("fixed_line_present", 0), r["per_kind"][k]["tasks"])
                if k in r.get("per_kind", {}) else "-" for r in splits.values()) + " |")
    for label, num, den in (("function calls: name right", "names_ok", "calls"),
                            ("function calls: arguments right", "calls_ok", "calls"),
                            ("function calls: exact", "calls_exact", "calls"),
                            ("function calls: values right", "values_ok", "values"),
                            ("function-calling tasks: all calls right", "tasks_ok", "tasks")):
        rows.append(f"| {label} | " + " | ".join(
            frac(r["function_calling"][num], r["function_calling"][den]) if r.get("function_calling") else "-"
            for r in splits.values()) + " |")
    if any(r.get("function_calling_stated") for r in splits.values()):  # cedar evaluate --stated-values
        for label, num, den in (("function calls narrowed to stated values (frontend help, apart): exact",
                                 "calls_exact", "calls"),
                                ("function calls narrowed to stated values: values right", "values_ok", "values")):
            rows.append(f"| {label} | " + " | ".join(
                frac(r["function_calling_stated"][num], r["function_calling_stated"][den])
                if r.get("function_calling_stated") else "-" for r in splits.values()) + " |")
    for label, num in (("OpenAI-API loops: end on their own", "ended"),
                       ("OpenAI-API loops: hit the turn limit", "hit_limit"), ("OpenAI-API loops: solved", "solved")):
        rows.append(f"| {label} | " + " | ".join(
            frac(r["api_loop"][num], r["api_loop"]["loops"]) if r.get("api_loop") else "-"
            for r in splits.values()) + " |")
    rows.append("| OpenAI-API loops: expected calls made | " + " | ".join(
        frac(r["api_loop"]["calls_right"], r["api_loop"]["calls_expected"]) if r.get("api_loop") else "-"
        for r in splits.values()) + " |")
    if all("answers_after_results" in r.get("api_loop", {}) for r in splits.values()):
        rows.append("| OpenAI-API loops: answers that state their results | " + " | ".join(
            frac(r["api_loop"]["answers_stating_results"], r["api_loop"]["answers_after_results"])
            for r in splits.values()) + " |")
    rows.append("| tasks in error | " + " | ".join(str(len(r.get("errors", []))) for r in splits.values()) + " |")
    notes = [f"- {name}: {r['note']}" for name, r in splits.items() if r.get("note")]
    return "\n".join([head, *rows] + ([""] + notes if notes else []))


def main(model_dir: str, eval_json: str, fidelity_json: str) -> None:
    model_dir = Path(model_dir)
    tr = json.loads((model_dir / "training.json").read_text())
    ev = json.loads(Path(eval_json).read_text())
    fid = json.loads(Path(fidelity_json).read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    beyond = bool(cfg.get("decoder_global_beyond_window"))
    beyond_text = ("; `decoder_global_beyond_window`: the decoder's indexers choose among global entries whose token "
                   "has left the window" if beyond else "")
    splits = ev["splits"]
    held_out = splits["heldout"]
    tasks = held_out["per_kind"]
    recall = tasks.get("recall", {})
    u = held_out["unconstrained_calls"]
    held = tr["heldout"] or {}
    task_modes = fid.get("tasks", {})
    mode_rows = "\n".join(f"| {label} | " + " | ".join(f"{k} {pct(v['success'])} ({v['tasks']})" for k, v in per.items()) + " |"
                          for label, per in task_modes.items())
    task_modes_text = ("Task success with and without hits (held-out ReAct / recall tasks):\n\n| served as | success |\n"
                       "|---|---|\n" + mode_rows) if task_modes else (
        "Task success with and without hits was not measured for this model: `cedar fidelity --tasks N` runs "
        "held-out ReAct and recall tasks, which it does not solve yet (0/10 each, figures in "
        "`models/cedar-agent/README.md`), so the comparison would read 0% against 0%.")
    gold = gold_recall_distances(model_dir, recall.get("tasks", 10))
    chain = stages(tr)
    # NOTE: an averaged model (`cedar stage average`) trained no steps: the losses are its last trained stage's
    trained = next(st for st in reversed(chain) if st.get("final_train_loss") is not None)
    held = trained.get("heldout") or {}
    loss_of = ("" if trained is tr else
               f"; these are stage {chain.index(trained) + 1}'s, before its weights were averaged (not measured after)")
    total_tokens = sum(st["tokens_seen"] for st in chain)
    timed = [st["train_seconds"] for st in chain if st.get("train_seconds") is not None]
    total_minutes = sum(timed) / 60
    minutes_text = (f"{total_minutes:.0f} minutes" if len(timed) == len(chain)
                    else f"{total_minutes:.0f} minutes for the {len(timed)} timed stages")
    solved = sum(v["ok"] for v in tasks.values())
    fc = held_out["function_calling"]
    loops = held_out.get("api_loop") or {}
    probes = (tr.get("probes") or [None])[-1]  # NOTE: one entry per eval; the last is the model's
    repeat = (probes or {}).get("repeat", {})
    summary_text = (
        f"**Held-out templates** (tool schemas, phrasings, bug kinds and entities no training example "
        f"uses), greedy, through a real server: it solves {solved} of {sum(v['tasks'] for v in tasks.values())} "
        f"tasks; {fc['calls_exact']} of {fc['calls']} constrained function calls are exact and {fc['values_ok']} of "
        f"{fc['values']} argument values right; {pct(u['valid_share'])} of its calls *without* any constraint parse "
        f"and validate"
        + (f"; {loops['ended']} of {loops['loops']} OpenAI-API tool loops end with a text answer on their own"
           if loops else "")
        + (". A random string repeated after a gap is continued right (top-1) "
           + ", ".join(f"{float(v):.0%} at {g}" for g, v in repeat.items()) + " tokens" if repeat else "")
        + f". Trained on {total_tokens / 1e6:.1f}M tokens in {len(chain)} warm-started stages (Training).")
    card = f"""---
license: other  # the Cedar repository's terms; training text: generated, plus Python stdlib source (PSF-2.0)
library_name: cedar
pipeline_tag: text-generation
tags: [causal-encoder-decoder, agents, tool-calling, sglang]
---

# cedar-agent

A {tr['parameters'] / 1e6:.1f}M-parameter causal encoder-decoder (CED) model with DeepSeek-V4.1-Flash's
attention layout scaled down (8 layers: encoder SWA, Full r2, Reuse, Reuse; decoder Full r1, Reuse,
Reindex, Reuse; hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads of latent {cfg['kv_latent_dim']}, window
{cfg['sliding_window']}, top-k {cfg['index_topk']}, context {cfg['max_position_embeddings']}{beyond_text}), trained from scratch on CPU to drive
Cedar's own agents. Served by `cedar serve` (SGLang 0.5.23 with Cedar's FP4 global / FP8 window
pools); the default model of `cedar serve`, `cedar agent run` and `make demo`.

{summary_text}

## Training

- **Copy curricula first** (`cedar curriculum`, the chain in `scripts/train_chain.sh`):
  random strings repeated inside 256-token rows (a copy head within the window), then repeated at
  every distance up to 1,024 tokens with the compressed attention first trained dense and the
  indexer distilled toward it (copying through the global entries past the window).
- **Agent corpus** (built offline from seed 0, nothing downloaded; the last stage, with copy and
  recall rows mixed in): Cedar's own agent programs (`cedar.agents`) run with a scripted policy
  that knows the answer (`cedar.training.corpus`): function calling over 520 generated tool schemas
  (random names, 1-4 parameters of integer, number, enum, string, array and nested-object types,
  values drawn uniformly; 400 train, 120 held out), paraphrased requests, 1-3 calls per turn and
  1-3 turns, some answered without a tool, every turn ending with a text answer (the last stage's
  corpus also runs some turns as an agent loop does: one call a request, and a call whose first
  result is an error, made again after a transient error and not after a permanent one, a call
  that stays failed ending the turn with an answer that says so); ReAct over
  generated facts with entity names split by hash; long-range recall (a value from the first tool
  result, asked for after 5-8 long notes); the coding agent in real sandboxes over 20 bug kinds (5
  held out); fork and subagent sessions; plus Python standard-library source (PSF licence). Every
  session is rendered by the real chat template with the hermes tool-call markup and tokenized at
  the gens' boundaries, as `CedarEndpoint` sends it. {tr['corpus_tokens']:,} tokens; a held-out
  split ({tr['heldout_tokens']:,} tokens) is drawn from its own seed stream and never trained on.
- **Tokenizer**: byte-level BPE, {cfg['vocab_size']} tokens trained on the corpus, `<tool_call>` and
  `</tool_call>` as single (non-special) tokens; 3.9 bytes/token on the corpus; `model_max_length`
  = {cfg['max_position_embeddings']}.
- **Runs** ({total_tokens / 1e6:.1f}M tokens in all, {minutes_text} on 2 CPU cores), each warm-started
  from the one before it (`--init`):

{stages_table(chain)}

Copy probes of the last stage's final eval (`cedar train --probe-only MODEL_DIR` measures them on
any model folder; through the training forward with bounded replay simulated):

{probes_table(probes, beyond)}

  The batched training forward (`cedar.training.dense`) computes the served model's maths
  (checked against the reference to 2e-5). 35% of steps simulate an encoder-side prefix hit with
  bounded replay (rows after the hit see only the last W replayed tokens and the cached global KV)
  and a narrowed prompt end; 25% narrowing only. The indexer learns by distillation from the
  attention over all visible entries. Data order and per-step replay plans depend only on (seed,
  step).
- Loss curve of the last stage: `loss_curve.png` / `loss_curve.json` in this folder (its training loss
  includes the copy and recall rows mixed in; the held-out points are agent sessions only). Held-out
  losses of different stages are not comparable when their corpora differ (stages 1-3 were scored
  on an earlier generator's sessions).

## Figures

Held-out loss (cold, all tokens / assistant tokens): **{held.get('loss', float('nan')):.3f} / {held.get('assistant_loss', float('nan')):.3f}** nats
(final training loss {trained['final_train_loss']:.3f}){loss_of}.

Through a real `cedar serve`, greedy (`{ev.get('command', 'cedar evaluate')}`; raw figures in
`docs/eval.json`). A coding task counts only when its test passes on the files the agent left; a
function call is right when every value is (an optional argument may be left out). The held-out
and in-template splits are scored apart:

{evaluation_tables(splits)}

- Long-range recall: {pct(recall.get('success', 0))} of {recall.get('tasks', 0)} recall tasks. In the gold (scripted) sessions of
  those tasks the value sits {gold['min']}-{gold['max']} tokens (median {gold['median']}) before the final answer,
  {gold['over']}/{gold['n']} of them more than 4W = 512 tokens back.
- Tool calls **without constraints** (OpenAI API, `tool_choice: auto`, every turn of the held-out
  function-calling tasks): {u['valid']}/{u['calls']} valid ({pct(u['valid_share'])}: parsed by Cedar's tool-call
  parser and valid against the schema), {u['right']}/{u['calls']} exactly right ({pct(u['right_share'])}).{made_text(u)}

## Fidelity of bounded replay (`cedar fidelity`)

Next-token distributions after a hit, through the served path, against exact replay:

{table_markdown(fid)}

{task_modes_text}

## Limits

- Small and briefly trained ({tr['parameters'] / 1e6:.1f}M parameters, {total_tokens / 1e6:.1f}M tokens seen in all):
  the Figures above are the measure of what it does; anything below its held-out rates there is
  not to be relied on.
- Outside the generated task families its text is fluent-looking nonsense; the coding tasks are
  one-line bugs in tiny modules; the facts are made-up names.
- Copying past the window relies on the compressed sparse attention (top-{cfg['index_topk']} of the global
  entries): the repeat probe and the indexer's recall above show how far it reaches.
"""
    (model_dir / "README.md").write_text(card)
    print(f"wrote {model_dir / 'README.md'}")
    write_fidelity_doc(fid, task_modes_text, Path("docs/fidelity.md"))


def write_fidelity_doc(fid: dict, task_modes_text: str, path: Path) -> None:
    doc = f"""# Fidelity of bounded replay: measured

Produced by `{fid.get('command', 'cedar fidelity')}` on the shipped model (`models/cedar-agent`),
through a real `cedar serve` (modes switched at run time), on held-out sessions (never trained on).
Plot: `docs/fidelity.png`; raw figures: `docs/fidelity.json`.

**Method.** A case is a held-out session S, a prompt end P at the start of an assistant turn and a
prefix hit H = P - {fid['new_tokens']} (or H = W for the first bucket; the radix tree holds S[:H]; snapshots off, so the
hit really replays).
Each approximation is compared with the mode that lacks only it: **bounded replay** (the last
min(W, H) = min({fid['W']}, H) tokens replayed, narrowing off) against `exact` (the whole prefix
replayed; the server never narrows under exact replay, so this is the no-approximation
reference); **narrowing** (the decoder on the prompt's last W rows) against bounded replay
without it; and **both**, the serving default, against exact. The
hit prefill's state is kept (a snapshot) and the gold continuation S[P:P+{fid['G']}] is scored by a
request that restores it: KL(exact || mode) at each of the {fid['G']} gold positions over exact's
{fid['top']} most likely tokens (they cover {100 * fid['approximations']['bounded replay']['H>4W'].get('top_mass', 0):.1f}% of its mass on long hits; a token outside the
mode's own top {fid['top']} counts at the mode's smallest listed logprob, so the figure is a lower bound; mean and p99), the mean change of the gold log-likelihood per token, and the share of
the next {fid['G']} greedy tokens (a separate request decoding from S[:P]) equal to exact's.

{table_markdown(fid)}

The zero-difference controls are exact zeros, bit for bit: hits of at most W tokens (bounded
replay then replays the whole prefix) and snapshot continuations (a cold prompt, then its
continuation restored from the snapshot: nothing is replayed in any mode).

{task_modes_text}
"""
    path.write_text(doc)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
