# Sourced by run-backbones.sh, run-backbone-topk.sh, run-data-scale.sh and run-bf16-control.sh: paired compares of
# two evaluated runs, by case, for each metric in $METRICS and each type (all, choice, noul, score), into
# $COMPARES/compare-A-vs-B[-EVAL][-SPLIT]-METRIC[-TYPE].json (COMPARES defaults to $OUT/bb-compare), errors appended
# to $COMPARES/compare.log; a compare newer than both evaluations it reads is kept. Needs OUT or COMPARES, METRICS
# and RLCD (the command, an array).
compare() {  # label A, run A, label B, run B [, evaluation name (RUN/eval-NAME; "" for RUN/eval) [, split]]
  local dir=${COMPARES:-$OUT/bb-compare} ev=${5:-} split=${6:-} metric t out
  local base="$dir/compare-$1-vs-$3${ev:+-$ev}${split:+-$split}" seen="eval${ev:+-$ev}/evaluation.json"
  for metric in $METRICS; do
    for t in all choice noul score; do
      out="$base-$metric$([ "$t" = all ] || echo "-$t").json"
      [ "$out" -nt "$2/$seen" ] && [ "$out" -nt "$4/$seen" ] && continue
      "${RLCD[@]}" compare "$2" "$4" ${ev:+--eval "$ev"} ${split:+--split "$split"} --metric "$metric" \
        $([ "$t" = all ] || echo "--type $t") --json-out "$out.tmp" > /dev/null 2>> "$dir/compare.log"
      mv "$out.tmp" "$out"
    done
  done
}
