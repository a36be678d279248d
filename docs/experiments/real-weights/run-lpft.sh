#!/usr/bin/env bash
# Table 4 of docs/experiments/real-weights.md: LP-FT. From the head-only RL+CE run of seed 0 (its trained head,
# LoRA still zero), LoRA joins for the same budget and cadence as the LoRA-from-scratch arm of run.sh
# (60 updates of one micro-batch of 8), so the two differ only in the head they start from.
# From the repo root, after run-head-only.sh:  bash docs/experiments/real-weights/run-lpft.sh > runs/rw3/lpft.log 2>&1
# (the measured run evaluated lpft-last in a separate command, with 2 threads: runs/rw3/lpft-last.log)
set -euo pipefail
RLCD=${RLCD:-".venv/bin/rlcd"}
OUT=${OUT:-runs/rw3}
STEPS=${STEPS:-60}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
EVERY=$((STEPS / 4))
OVERRIDES=(--recipe grad_accum=1 --recipe dev_cap=16 --recipe "eval_every=$EVERY"
           --recipe "checkpoint_every=$EVERY" --recipe log_every=1 --recipe "diagnostics_every=$EVERY")
stamp() { echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) :: $*"; }

stamp "train lpft (init: $OUT/ablation/runs/rlcd-ce_weight1-s0)"
t0=$SECONDS
$RLCD train "$OUT/lpft" --model smollm2-135m --data "$OUT/processed" --steps "$STEPS" --seed 0 --objective rlcd \
  --sigma 0.3 "${OVERRIDES[@]}" --init "$OUT/ablation/runs/rlcd-ce_weight1-s0" --device cpu
stamp "train lpft done in $((SECONDS - t0)) s"
t0=$SECONDS
$RLCD evaluate "$OUT/lpft" --device cpu
stamp "evaluate lpft done in $((SECONDS - t0)) s (LoRA moved the backbone: no feature cache, shared-prefix scoring)"
# dev selection may keep update 0 (the head-only init, LoRA still zero); what the 60 LoRA updates left is
# evaluated on a copy with --checkpoint last (the backbone runs: its weights moved, so no feature cache applies)
rm -rf "$OUT/lpft-last" && mkdir -p "$OUT/lpft-last"
(cd "$OUT/lpft" && tar --exclude=./eval --exclude=./export -cf - .) | (cd "$OUT/lpft-last" && tar -xf -)
t0=$SECONDS
$RLCD evaluate "$OUT/lpft-last" --checkpoint last --device cpu
stamp "evaluate lpft-last done in $((SECONDS - t0)) s (the live backbone, shared-prefix scoring of 1,200 rows)"
for metric in nll brier accuracy; do  # head-only (the init) vs what LoRA left
  $RLCD compare "$OUT/ablation/runs/rlcd-ce_weight1-s0" "$OUT/lpft-last" --metric "$metric" \
    --json-out "$OUT/compare-headonly-vs-lpft-$metric.json" > /dev/null
done
