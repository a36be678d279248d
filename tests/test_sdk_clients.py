"""TypeSafe's System One client family against a real `rlcd serve` on loopback (the tiny test export).

The clients live in `.venv-clients/` (Python 3.13, `make clients`, pinned in requirements-clients.txt): the
official `typesafe-sdk` (sync and async: every question type, one and many questions, zstd and plain bodies,
multipart and JSON images, `models.list()`, `request_id`, a wrong key), `langchain-typesafe`, `jev-cli`, the
`jevcompat` conformance suite (every MUST and SHOULD), and `jev-eval run` whose thresholds on the labeled rows it
sent must agree with `rlcd.gate` on the same answers. Offline without that venv these skip, saying why (under CI
they fail: CI builds it). One server for the module: it loads in ~10 s.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _clients import clients_bin, run_client
from _tiny_export import tiny_export

HERE = Path(__file__).parent
KEY = "sdk-family-key.7"
THRESHOLDS = {  # hand-written in the contract: per-type gates and a row gate, as `rlcd gate` writes them
    "version": 1, "model": "tiny-run", "generatedAt": "2026-01-01T00:00:00Z",
    "guard": {"method": "bootstrap", "resamples": 1000, "seed": 0}, "tolerance": 0, "questions": {},
    "definitions": {},
    "x_rlcd": {"types": {"choice": {"type": "choice", "threshold": 0.0, "accuracy": 0.9, "coverage": 1.0, "n": 60},
                         "noul": {"type": "noul", "threshold": 1.01, "accuracy": 0.9, "coverage": 0.0, "n": 60}},
               "rowGate": {"threshold": 0.0, "accuracy": 0.9, "coverage": 1.0, "n": 60}}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    clients_bin()  # skip (or fail under CI) before starting anything
    base = tmp_path_factory.mktemp("sdk")
    run = tiny_export(tmp_path_factory.getbasetemp())
    (base / "thresholds.json").write_text(json.dumps(THRESHOLDS))
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLCD_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "rlcd.cli", "serve", "--run", str(run), "--port", str(port),
                             "--quiet", "--thresholds", str(base / "thresholds.json")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"rlcd serve did not come up: {proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    yield {"url": url, "dir": base, "run": run}
    proc.terminate()
    proc.wait(30)


def _png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (40, 24), (200, 30, 30)).save(path, format="PNG")
    return path


def test_typesafe_sdk_and_langchain(server):
    png = _png(server["dir"] / "red.png")
    out = run_client([str(clients_bin()), str(HERE / "clients" / "sdk_family.py"), server["url"], KEY, str(png)])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for name, qtype in (("refund", "noul"), ("team", "choice"), ("anger", "score")):
        assert got[f"one_{name}"]["type"] == qtype and len(got[f"one_{name}"]["request_id"]) >= 16
    many = got["many"]
    assert (many["nouls"], many["choices"], many["scores"]) == (["refund"], ["team"], ["anger"])
    assert many["answers"]["anger"]["legend"] == {"0": "Calm", "1": "Frustrated", "2": "Very angry"}
    assert many["usage"]["input_tokens"] > 0 and many["usage"]["output_tokens"] == 0
    # zstd: the SDK compressed the >1 KiB body, and the answers equal the uncompressed request's
    assert got["zstd_available"] and got["zstd"]["sent"]["content_encoding"] == "zstd"
    assert got["zstd"]["answers"] == got["uncompressed"]["answers"]
    assert got["models"][0]["name"] == "tiny-run" and len(got["models"][0]["release_date"]) == 10
    # images: multipart from `assets` and from attached assets, JSON data_base64; each one is read
    assert got["image_assets"]["sent"]["content_type"].startswith("multipart/form-data")
    assert got["image_attached"]["sent"]["content_type"].startswith("multipart/form-data")
    assert got["image_json"]["sent"]["content_type"] == "application/json"
    assert got["image_assets"]["images"] == got["image_attached"]["images"] == got["image_json"]["images"] == 1
    assert got["image_assets"]["answer"] == got["image_json"]["answer"]  # same image, same state: same answer
    # x_gate through extra_body: the per-type gates of the thresholds file (noul's 1.01 escalates everything)
    assert got["gated"]["team"] == {"decision": "auto", "confidence": got["gated"]["team"]["confidence"],
                                    "threshold": 0.0, "gate": "x_rlcd.types.choice"}
    assert got["gated"]["refund"]["decision"] == "escalate" and "decision" not in got["gated"]["anger"]
    assert got["gated_row"]["gate"] == "x_rlcd.rowGate" and got["bad_extension"] == 422
    assert got["wrong_key"]["status"] == 401 and got["wrong_key"]["body"]["detail"]["error_type"] == "authentication_error"
    assert "Invalid API key" in got["wrong_key"]["message"]
    assert got["async"]["answers"] == [["anger", "refund", "team"]] * 3 and len(set(got["async"]["ids"])) == 3
    assert got["async"]["models"] == ["tiny-run"]
    assert 0 <= got["langchain"]["noul"] <= 1 and got["langchain"]["choice"] in ("billing", "shipping")
    assert got["langchain_async"]["choice"] == got["langchain"]["choice"]


def test_jev_cli(server):
    jev = str(clients_bin("jev"))
    env = {"JEV_PROVIDER": "custom", "JEV_ENDPOINT": f"{server['url']}/v1/systemone", "JEV_API_KEY": KEY,
           "XDG_CONFIG_HOME": str(server["dir"] / "xdg")}
    p = float(run_client([jev, "noul", "-q", "Is the parcel late?", "-s", "It is two weeks late.", "--value"], env=env).stdout)
    assert 0 <= p <= 1
    choice = run_client([jev, "choice", "-q", "Team?", "-s", "Charged twice.", "-o", "billing=money", "-o",
                         "shipping=parcels", "--value"], env=env).stdout.strip()
    assert choice in ("billing", "shipping")
    score = json.loads(run_client([jev, "score", "-q", "Urgency?", "-s", "Now!", "-l", "low", "-l", "high"], env=env).stdout)
    assert set(score["answers"]["answer"]["legend"].values()) == {"low", "high"}
    req = server["dir"] / "req.json"
    req.write_text(json.dumps({"state": {"order": 7}, "questions": {"a": {"type": "noul"}, "b": {
        "type": "score", "criteria": ["x", "y", "z"]}}}))
    assert set(json.loads(run_client([jev, "run", str(req)], env=env).stdout)["answers"]) == {"a", "b"}
    bad = run_client([jev, "noul", "-q", "x", "-s", "y"], env={**env, "JEV_API_KEY": "nope"}, check=False)
    assert bad.returncode == 3 and "401" in bad.stderr


def test_jevcompat_every_must_and_should(server):
    report = server["dir"] / "jevcompat.json"
    out = run_client([str(clients_bin("jevcompat")), "test", server["url"], "--key", KEY, "--json", str(report)],
                     check=False)
    doc = json.loads(report.read_text())
    results = {r["id"]: r["status"] for r in doc["results"]}
    failed = {k: v for k, v in results.items() if v == "fail"}
    assert not failed, (failed, out.stdout[-4000:])
    assert out.returncode == 0 and "conformant to spec" in out.stdout and "not conformant" not in out.stdout
    skipped = sorted(k for k, v in results.items() if v == "skip")
    # auth.ignored-when-off applies to a server without a key (this one has one); errors.shape is only reached by
    # a 4xx other than 422 for an unknown model, and rlcd answers any model name unless --strict-model
    assert skipped == ["auth.ignored-when-off", "errors.shape"], skipped


def test_jev_eval_run_agrees_with_rlcd_gate(server):
    """jev-eval run against rlcd serve, then its thresholds vs rlcd.gate's on the same answers and gold."""
    from rlcd import gate as G

    d = server["dir"] / "jev-eval"
    d.mkdir()
    questions = {"team": {"kind": "choice", "instructions": "Which team?",
                          "options": {"billing": "payments", "shipping": "parcels", "returns": "returns"}},
                 "late": {"kind": "noul", "instructions": "Is the parcel late?"},
                 "urgency": {"kind": "score", "instructions": "How urgent?", "levels": ["low", "mid", "high"]}}
    (d / "config.json").write_text(json.dumps({"model": "jev-latest", "questions": questions}))
    teams, levels = ["billing", "shipping", "returns"], ["low", "mid", "high"]
    rows = [{"state": f"Ticket {i}: parcel {i % 7} days late, invoice {i % 5} paid {i % 3} times.",
             "labels": {"team": teams[(i * 7) % 3], "late": i % 2 == 0, "urgency": levels[(i * 5) % 3]}} for i in range(60)]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"JEV_API_KEY": KEY, "TYPESAFE_AI_BASE_URL": f"{server['url']}/v1"}
    ev = str(clients_bin("jev-eval"))
    run_client([ev, "run", "--data", str(d / "rows.jsonl"), "--config", str(d / "config.json"), "--cache",
                str(d / "cache.jsonl")], env=env)
    run_client([ev, "thresholds", "--cache", str(d / "cache.jsonl"), "--max-escalation", "0.5", "--out",
                str(d / "jev.json")], env=env)
    script = ("import json, sys\nfrom jev_eval import load_cache, score_records, recommend_all, GuardOptions\n"
              "from jev_eval.thresholds import picker\n"
              "recs = recommend_all(score_records(load_cache(sys.argv[1])), picker(None, 0.5), "
              "GuardOptions('bootstrap', 1000, 0.0, 0))\n"
              "print(json.dumps({r.qid: [r.point.threshold, r.point.accuracy, list(r.interval.accuracy)] "
              "for r in recs if r.usable}))")
    theirs = json.loads(run_client([str(clients_bin()), "-c", script, str(d / "cache.jsonl")]).stdout.strip())
    jev_doc = json.loads((d / "jev.json").read_text())
    assert {"team", "late", "urgency"} <= set(theirs), theirs  # 60 rows: usable (provisional) gates, not refused
    # the same answers as rlcd prediction rows: logits = log p with T = 1, one case per labeled row
    preds = []
    for rec in map(json.loads, (d / "cache.jsonl").read_text().splitlines()):
        a, q = rec["answer"], rec["question"]
        if rec["type"] == "noul":
            p, target = [1 - a["noul"], a["noul"]], [0.0, 1.0] if rec["gold"] else [1.0, 0.0]
        else:
            keys = list(q["criteria"]) if rec["type"] == "choice" else [str(i) for i in range(len(q["criteria"]))]
            p = [a["probabilities"][k] for k in keys]
            gold = keys.index(rec["gold"]) if rec["type"] == "choice" else list(q["criteria"]).index(rec["gold"])
            target = [1.0 if i == gold else 0.0 for i in range(len(keys))]
        preds.append({"id": f"r{rec['row']}:{rec['id']}", "case_id": f"r{rec['row']}", "group": "g", "type": rec["type"],
                      "target": target, "logits": [math.log(max(x, 1e-300)) for x in p]})
    ours = G.thresholds_document(preds, [], {"choice": 1.0, "noul": 1.0, "score": 1.0}, G.Goal(max_escalation=0.5),
                                 model="jev-latest", yes_targets=())
    gates = {g["name"]: g for g in ours["x_rlcd"]["gates"]}
    assert set(theirs) == set(jev_doc["questions"]) | ({"_row"} if "composite" in jev_doc else set())
    assert set(theirs) == set(ours["questions"]) | ({"_row"} if "composite" in ours else set())
    for qid, (t, acc, acc95) in theirs.items():
        g = gates[qid]
        assert g["threshold"] == pytest.approx(t, abs=1e-6), qid  # the same pick on the same rows
        assert acc95[0] <= g["accuracy"] <= acc95[1] and g["accuracy95"][0] <= acc <= g["accuracy95"][1], (qid, g, acc95)
