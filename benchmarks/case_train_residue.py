"""Where the shared-prefix training residue on the hybrid Qwen3.5 cache comes from (float64 experiment).

Run: PYTHONPATH=src python benchmarks/case_train_residue.py [--json OUT.json]  (not into benchmarks/results/:
that directory holds `rlcd bench` results only).

The random `tiny` preset in float64, LoRA B set to small random values (so every LoRA tensor has a
gradient), two six-question synth cases (five rows each) and one single row. The CE loss of the same
rows is backpropagated once through full rows (`DecisionModel.forward`) and once through the shared-
prefix training path (`case_forward`), in four settings:

* cut `aligned` on the 64-token DeltaNet chunk grid (what training uses) or `unaligned` (the common
  prefix, as the first probe in QWEN35-NOTES.md did; the suffix then starts mid-chunk);
* DeltaNet kernel `fp32` (transformers' reference `torch_chunk_gated_delta_rule`, which casts its inputs
  to float32 whatever the model dtype) or `fp64` (the same function with that cast made to the input
  dtype: a float64 reference).

Printed per setting: the loss's relative difference, the largest logit difference, the gradient's
relative difference (all trainable tensors as one vector) and the worst single tensor's; and, for the
fp32 kernel, each path's gradient error against the float64-kernel full rows (the truth).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap

import torch

torch.set_num_threads(1)


def fp64_kernel():
    """transformers' torch_chunk_gated_delta_rule computing in the input dtype instead of float32."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    fn = inspect.unwrap(M.torch_chunk_gated_delta_rule)
    src = textwrap.dedent(inspect.getsource(fn))
    src = src[src.index("def "):]
    assert src.count("x.transpose(1, 2).to(torch.float32") == 1, "kernel source changed: update the patch"
    src = src.replace("x.transpose(1, 2).to(torch.float32", "x.transpose(1, 2).to(initial_dtype")
    ns = dict(vars(M))
    exec(compile(src, "<fp64 chunk_gated_delta_rule>", "exec"), ns)
    return ns[fn.__name__]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    from rlcd.data.synth import generate
    from rlcd.model import case_train
    from rlcd.model.plan import shared_prefix_len
    from rlcd.model.backbone import load_backbone
    from rlcd.model.decision import DecisionModel
    from rlcd.objectives import ce_loss

    dm = DecisionModel(load_backbone("tiny", seed=0, dtype=torch.float64), seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in dm.backbone.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    by: dict[str, list] = {}
    for r in generate(3, seed=5):
        by.setdefault(r.case_id, []).append(r)
    cases = list(by.values())
    units = [cases[0][:5], cases[1][:5], [cases[2][0]]]
    col = dm.collator()
    cb = case_train.collate_cases(col, units)
    fb = col([r for u in units for r in u])
    dm.train()

    def run(batch):
        dm.zero_grad(set_to_none=True)
        lg = dm(batch)
        loss, _ = ce_loss(lg, batch.cand_mask, batch.target)
        loss.backward()
        dm.head.reset_pending()
        grads = {n: p.grad.detach().clone() for n, p in dm.named_parameters() if p.grad is not None}
        return lg.detach(), float(loss.detach()), grads

    def vec(gr):
        return torch.cat([gr[k].flatten() for k in sorted(gr)])

    def compare(a, b):
        worst = max((float((a[2][k] - b[2][k]).norm() / a[2][k].norm()), k) for k in a[2])
        m = cb.cand_mask
        return {"loss_rel": abs(a[1] - b[1]) / abs(a[1]),
                "logit_max_abs": float((a[0][m] - b[0][m]).abs().max()),
                "grad_rel": float((vec(a[2]) - vec(b[2])).norm() / vec(a[2]).norm()),
                "worst_tensor_rel": worst[0], "worst_tensor": worst[1].split("model.language_model.")[-1]}

    shipped, ref, cut = M.torch_chunk_gated_delta_rule, fp64_kernel(), case_train.unit_prefix_len

    def unaligned(model, rows, n_img):
        return shared_prefix_len(rows, n_img) if len(rows) > 1 else None

    out: dict = {"model": "tiny (float64)", "rows": len(cb), "cuts": {}, "settings": {}}
    results = {}
    try:
        for kname, kernel in (("fp32", shipped), ("fp64", ref)):
            M.torch_chunk_gated_delta_rule = kernel
            full = run(fb)
            results[("full", kname)] = full
            for aname, fn in (("aligned", cut), ("unaligned", unaligned)):
                case_train.unit_prefix_len = fn
                out["cuts"][aname] = [fn(dm, cb.rows[u.start:u.end], u.n_img) for u in cb.units]
                res = run(cb)
                results[(aname, kname)] = res
                out["settings"][f"{aname}/{kname}"] = compare(full, res)
    finally:
        M.torch_chunk_gated_delta_rule, case_train.unit_prefix_len = shipped, cut
    truth = results[("full", "fp64")]
    out["vs_fp64_truth"] = {name: compare(truth, results[(name, "fp32")]) for name in ("full", "aligned", "unaligned")}
    print(f"rows {len(cb)}, row lengths {[len(r) for r in cb.rows]}, cuts {out['cuts']}")
    print(f"{'setting':<18} {'loss rel':>9} {'logit max':>9} {'grad rel':>9} {'worst rel':>9}  worst tensor")
    for name, c in list(out["settings"].items()) + [(f"{k} vs truth", v) for k, v in out["vs_fp64_truth"].items()]:
        print(f"{name:<18} {c['loss_rel']:>9.1e} {c['logit_max_abs']:>9.1e} {c['grad_rel']:>9.1e} "
              f"{c['worst_tensor_rel']:>9.1e}  {c['worst_tensor']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
