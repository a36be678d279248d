#!/usr/bin/env bash
# Send real requests to a running any2jev server with curl and save the raw responses.
#   bash benchmarks/peers/any2jev/probe.sh PORT CONVERTED_TEST_JSONL OUT_JSON
# CONVERTED_TEST_JSONL: a file written by to_any2jev.py (its first record's state and questions are used).
# Sends: GET /v1/models, GET /health, one request per question type (choice / noul / score), all six
# questions in one request (timed 5x), and error probes (bad JSON, no questions, unknown type, extra
# top-level field, 100 questions, a wrong model name, an over-long option). Labels are stripped.
set -euo pipefail
PORT="${1:?PORT}"; SRC="${2:?CONVERTED_TEST_JSONL}"; OUTF="${3:?OUT_JSON}"
URL="http://127.0.0.1:$PORT"
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
python3 - "$SRC" "$T" <<'PY'
import json, sys
src, t = sys.argv[1], sys.argv[2]
rec = json.loads(open(src, encoding="utf-8").readline())
qs = {k: {kk: vv for kk, vv in q.items() if kk != "label"} for k, q in rec["questions"].items()}
def pick(kind):
    k = next(k for k, q in qs.items() if q["type"] == kind)
    return {k: qs[k]}
def w(name, body): open(f"{t}/{name}.json", "w", encoding="utf-8").write(body if isinstance(body, str) else json.dumps(body, ensure_ascii=False))
base = {"model": "any2jev-latest", "state": rec["state"]}
for kind in ("choice", "noul", "score"):
    w(kind, {**base, "questions": pick(kind)})
w("all6", {**base, "questions": qs})
w("err_bad_json", '{"model": "x", "state": ')
w("err_no_questions", {**base, "questions": {}})
w("err_unknown_type", {**base, "questions": {"q": {"type": "rank", "instructions": "?"}}})
w("extra_top_level_field", {**base, "questions": pick("noul"), "metadata": {"trace": 1}})
w("many_100_questions", {**base, "questions": {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(100)}})
w("wrong_model_name", {**base, "model": "no-such-model", "questions": pick("noul")})
w("err_option_too_long", {**base, "questions": {"q": {"type": "choice", "criteria": {"a": "word " * 1200, "b": None}}}})
PY
req() {  # name method path [bodyfile]
  local name="$1" method="$2" path="$3" body="${4:-}"
  local args=(-s -X "$method" -D "$T/$name.h" -o "$T/$name.b" -w '%{http_code} %{time_total}' -H 'content-type: application/json' -H 'Authorization: Bearer local')
  [[ -n "$body" ]] && args+=(--data-binary "@$body")
  curl "${args[@]}" "$URL$path" > "$T/$name.s"
}
req models GET /v1/models
req health GET /health
for n in choice noul score all6 err_bad_json err_no_questions err_unknown_type extra_top_level_field many_100_questions wrong_model_name err_option_too_long; do
  req "$n" POST /v1/systemone "$T/$n.json"
done
for i in 1 2 3 4 5; do req "all6_timing_$i" POST /v1/systemone "$T/all6.json"; done
for i in 1 2 3 4 5; do req "noul_timing_$i" POST /v1/systemone "$T/noul.json"; done
python3 - "$T" "$OUTF" "$URL" <<'PY'
import json, os, sys
t, outf, url = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"server": url, "note": "raw responses from any2jev 0.1.0 (curl); time_s = curl time_total on this 2-core CPU, nice 10, OMP_NUM_THREADS=1, beside a running experiment", "exchanges": {}}
names = sorted({f[:-2] for f in os.listdir(t) if f.endswith(".s")}, key=lambda n: (n.startswith(("all6_t", "noul_t")), n))
for n in names:
    code, secs = open(f"{t}/{n}.s").read().split()
    raw = open(f"{t}/{n}.b", encoding="utf-8", errors="replace").read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw
    hdr = {}
    for line in open(f"{t}/{n}.h", encoding="latin-1").read().splitlines()[1:]:
        if ":" in line:
            k, v = line.split(":", 1); hdr[k.strip().lower()] = v.strip()
    req = None
    if os.path.exists(f"{t}/{n.split('_timing')[0]}.json"):
        r = open(f"{t}/{n.split('_timing')[0]}.json", encoding="utf-8").read()
        try:
            req = json.loads(r)
            if n == "many_100_questions" or n == "err_option_too_long":
                req = {"summary": f"{len(req['questions'])} question(s); see probe.sh"}
        except ValueError:
            req = r
    if "_timing_" in n:
        req = "(same as " + n.split("_timing")[0] + ")"
    out["exchanges"][n] = {"request": req, "status": int(code), "time_s": float(secs), "headers": hdr, "response": body}
json.dump(out, open(outf, "w", encoding="utf-8"), indent=1, ensure_ascii=False)
for n, e in out["exchanges"].items():
    print(f"{n:24s} {e['status']} {e['time_s']:.3f}s")
PY
