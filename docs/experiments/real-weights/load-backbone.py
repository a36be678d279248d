"""Load one backbone (a preset or a .gguf file), time it and print its top-5 next tokens after a fixed prompt.

usage: /usr/bin/time -f "wall %e s, peak RSS %M kB" python docs/experiments/real-weights/load-backbone.py SPEC
(the "Backbones" section of docs/experiments/real-weights.md ran it with OMP_NUM_THREADS=1)
"""
import sys, time, json, torch
t = time.time()
from rlcd.model.backbone import load_backbone
bb = load_backbone(sys.argv[1])
load_s = time.time() - t
tok, m = bb.tokenizer, bb.model
ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = m(input_ids=ids).logits[0, -1]
top = torch.topk(torch.log_softmax(logits.double(), -1), 5)
print(json.dumps({"load_s": round(load_s, 2), "params": sum(p.numel() for p in m.parameters()),
                  "top5": [(tok.decode([int(i)]), round(float(v), 3)) for v, i in zip(top.values, top.indices)],
                  "info": {k: bb.info.get(k) for k in ("preset", "vocab", "vocab_size", "marker_token", "chat_template", "license", "package", "origin", "num_layers", "hidden_size")}}, indent=1))
