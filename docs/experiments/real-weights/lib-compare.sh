# Sourced by run-backbones.sh and run-backbone-topk.sh: paired compares of two evaluated runs, by case, into
# $OUT/bb-compare/compare-A-vs-B-METRIC[-TYPE].json for each metric in $METRICS and each type (all, choice, noul,
# score); a compare newer than both evaluations is kept. Needs OUT, METRICS and RLCD (the command, an array).
compare() {  # label A, run A, label B, run B
  local base="$OUT/bb-compare/compare-$1-vs-$3" metric t out
  for metric in $METRICS; do
    for t in all choice noul score; do
      out="$base-$metric$([ "$t" = all ] || echo "-$t").json"
      [ "$out" -nt "$2/eval/evaluation.json" ] && [ "$out" -nt "$4/eval/evaluation.json" ] && continue
      "${RLCD[@]}" compare "$2" "$4" --metric "$metric" $([ "$t" = all ] || echo "--type $t") --json-out "$out.tmp" \
        > /dev/null 2>> "$OUT/bb-compare/compare.log"
      mv "$out.tmp" "$out"
    done
  done
}
