#!/usr/bin/env python3
"""Run the official TypeSafe SDK (typesafe-sdk 0.7.5) against a running any2jev server.
    /work/peers/any2jev-venv/bin/python sdk_check.py PORT CONVERTED_TEST_JSONL
Asks the first record's questions (labels stripped) once per type and all together, lists models,
and prints what the SDK parsed, or the exception it raised."""
import json
import sys

from typesafe_sdk import Choice, Noul, Score, TypeSafeClient

port, src = sys.argv[1], sys.argv[2]
rec = json.loads(open(src, encoding="utf-8").readline())
client = TypeSafeClient(api_key="local", base_url=f"http://127.0.0.1:{port}", model="any2jev-latest")


def sdk_q(q):
    kw = {"instructions": q.get("instructions")}
    if q["type"] == "choice":
        return Choice(criteria=q["criteria"], **kw)
    if q["type"] == "score":
        return Score(criteria=q["criteria"], **kw)
    return Noul(criteria=q["criteria"], **kw) if q.get("criteria") else Noul(**kw)


qs = {k: sdk_q(q) for k, q in rec["questions"].items()}
ok = True
try:
    print("models.list:", client.models.list())
except Exception as e:  # noqa: BLE001
    ok = False
    print("models.list FAILED:", type(e).__name__, e)
try:
    r = client.system_one(state=rec["state"], questions=qs)
    print("system_one: model", r.model, "usage", r.usage)
    for k, a in r.choices.items():
        print(" choice", k, a.choice, dict(a.probabilities), a.confidence)
    for k, a in r.nouls.items():
        print(" noul", k, a.noul)
    for k, a in r.scores.items():
        print(" score", k, a.score, dict(a.legend), getattr(a, "confidence", None))
except Exception as e:  # noqa: BLE001
    ok = False
    print("system_one FAILED:", type(e).__name__, e)
sys.exit(0 if ok else 1)
