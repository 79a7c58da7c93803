#!/usr/bin/env bash
# Issue 21's training chain, stage by stage, resumable: every stage resumes from its own
# checkpoint, and a finished stage leaves RUNS/<stage>.done, so running this again (after a stop, a
# crash or in a later session) goes on where it stopped. Long: hours on 2 cores; run it in the
# background with its log in a file, and stop it (kill) for a benchmark or a test run:
#
#     nohup scripts/train_chain.sh runs > runs/chain.log 2>&1 &
#
# RUNS (default runs/): the run folders (checkpoints, curves, probes, exported models); keep it out
# of commits. THREADS (default 2): torch threads.
#
# A session's RUNS does not outlive its machine, and the chain is longer than a session, so a
# finished stage's model is also kept in the repo, once, in float16 (`cedar stage`, training/stages.py:
# training/checkpoints/<stage>.safetensors, committed by hand); a later session's chain restores
# the newest one it finds and starts after it. Only the chain's end is the shipped model (models/).
#
# 1. copy256: the short-context copy curriculum (a copy head inside the window);
# 2. recall1k: strings repeated at every distance up to 1,024, the first 500 steps attending every
#    global entry with the indexer distilled toward that attention (an earlier 2,400-step run's
#    repeat probe had flattened by step 300-700: RECALL_STEPS, default 700);
# 3. agent: the agent corpus with copy and recall rows mixed in (cedar train);
# 4. eval: cedar evaluate on the held-out templates (RUNS/eval.json).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs}
T=${THREADS:-2}
PY=.venv/bin/python
mkdir -p "$RUNS"
# the agent stage's matmuls in bfloat16 where this CPU multiplies it natively (about 2x), else float32
BF16=$($PY -c "from cedar.training.trainer import bf16_is_native; print('--bf16' if bf16_is_native() else '')")
CKPT=training/checkpoints

# a stage kept in the repo by an earlier session: restore its model, mark it and those before done
restore() {
  local name=$1
  shift
  if [ -f "$CKPT/$name.safetensors" ] && [ ! -f "$RUNS/$name-export.done" ]; then
    echo "[chain] $name: restored from $CKPT/$name.safetensors"
    $PY -m cedar.cli stage restore "$CKPT/$name.safetensors" "$RUNS/$name/model"
    for s in "$@" "$name" "$name-export" "$name-keep"; do touch "$RUNS/$s.done"; done
  fi
}
restore recall1k copy256 copy256-export copy256-keep
restore copy256

stage() {
  local name=$1
  shift
  if [ -f "$RUNS/$name.done" ]; then
    echo "[chain] $name: done"
    return 0
  fi
  echo "[chain] $name: $* ($(date -u +%H:%M))"
  nice -n 10 "$@"
  touch "$RUNS/$name.done"
}

stage copy256 $PY -m cedar.cli curriculum --init models/cedar-agent --out "$RUNS/copy256" --kind copy \
  --seq-len 256 --batch 16 --steps 850 --lr 1e-3 --threads "$T"
stage copy256-export $PY -m cedar.cli curriculum --init models/cedar-agent --out "$RUNS/copy256" \
  --export "$RUNS/copy256/model"
stage copy256-keep $PY -m cedar.cli stage save "$RUNS/copy256/model" "$CKPT/copy256.safetensors" \
  --note "copy256: copy_curriculum --kind copy --seq-len 256 --batch 16 --steps 850 --lr 1e-3"
stage recall1k $PY -m cedar.cli curriculum --init "$RUNS/copy256/model" --out "$RUNS/recall1k" --kind recall \
  --seq-len 1024 --batch 4 --steps ${RECALL_STEPS:-700} --dense-steps 500 --lr 1e-3 --threads "$T" --aux-weight 1.0 --aux-stride 1
stage recall1k-export $PY -m cedar.cli curriculum --init "$RUNS/copy256/model" --out "$RUNS/recall1k" \
  --export "$RUNS/recall1k/model"
stage recall1k-keep $PY -m cedar.cli stage save "$RUNS/recall1k/model" "$CKPT/recall1k.safetensors" \
  --note "recall1k: copy_curriculum --kind recall --seq-len 1024 --batch 4 --dense-steps 500 --lr 1e-3 from copy256"
stage agent $PY -m cedar.cli train --init "$RUNS/recall1k/model" --out "$RUNS/agent" --steps ${AGENT_STEPS:-1500} \
  --copy-share 0.3 --recall-share 0.5 --context-weight 0.05 --lr ${AGENT_LR:-1e-3} --threads "$T" --no-progress $BF16
stage eval $PY -m cedar.cli evaluate --model "$RUNS/agent/model" --limit 4 --json "$RUNS/eval.json"
echo "[chain] finished: the model is $RUNS/agent/model, its evaluation $RUNS/eval.json"
