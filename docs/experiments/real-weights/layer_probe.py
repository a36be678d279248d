"""Probe: the demo's head-only run reading SmolLM2-135M's layer L instead of its last (30).

The backbone is cut after decoder layer L (its final norm kept), so the cached features are layer L's
normalised residual stream. Prints one JSON line: accuracy and raw KL(posterior || model) on the
calibration and test splits (the synth targets are the posteriors, so raw KL = raw NLL gap).

    for L in 30 12 18 24; do python docs/experiments/real-weights/layer_probe.py $L 1 /tmp/layerprobe; done
"""
import sys, time, math, json, shutil, torch
from pathlib import Path
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
L = int(sys.argv[1])
import rlcd.model.build as B
orig = B.load_backbone
def patched(*a, **k):
    bb = orig(*a, **k)
    core = bb.model.model
    if L < len(core.layers):
        core.layers = core.layers[:L]
        cfg = bb.model.config
        cfg.num_hidden_layers = L
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:L]
    return bb
B.load_backbone = patched
from rlcd.data.io import load_split
from rlcd.demo import demo_data, demo_recipe
from rlcd.evaluate import predict_rows
from rlcd.export import load_checkpoint_model
from rlcd.features import find_features
from rlcd.metrics import majority_baseline
from rlcd.train import train
t0 = time.perf_counter()
tmp = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/layerprobe") / f"L{L}"
shutil.rmtree(tmp, ignore_errors=True)
demo_data(tmp, seed=0)
data = tmp / "processed"
train(tmp / "run", data_dir=data, model="smollm2-135m", recipe=demo_recipe(), progress=False)
model, _, _ = load_checkpoint_model(tmp / "run", "best")
f = find_features(model, data)
out = {"L": L}
for split in ("calibration", "test"):
    recs = load_split(data, split)
    rows = predict_rows(model, recs, model.collator(image_root=data), split=split, features=f)
    by = {r.id: r for r in recs}
    acc = gap = kl = 0.0
    n = 0
    for r in rows:
        lg = torch.tensor(r["logits"], dtype=torch.float64)
        lp = torch.log_softmax(lg, -1)
        t = torch.tensor(r["target"], dtype=torch.float64)
        rec = by[r["id"]]
        p = torch.tensor(rec.posterior, dtype=torch.float64)
        acc += float(lg.argmax() == t.argmax())
        gap += float(-(t * lp).sum() + (t * torch.log(p.clamp_min(1e-12))).sum())
        kl += float((p * (torch.log(p.clamp_min(1e-12)) - lp)).sum())
        n += 1
    maj = majority_baseline(load_split(data, "train"), recs)["accuracy"]
    out[split] = {"n": n, "acc": acc / n, "majority": maj, "raw_gap": gap / n, "raw_kl": kl / n}
out["wall_s"] = time.perf_counter() - t0
print("PROBE", json.dumps(out), flush=True)
