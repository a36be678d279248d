"""Write `export/hf/`: the merged model as plain transformers + safetensors load it.

    export/hf/
      config.json               RlcdDecisionConfig (backbone class + config, scorer size), auto_map
      model.safetensors         backbone.* (LoRA merged) + w_d, w_c, mu_d, mu_c
      modeling_rlcd.py          RlcdForDecision (DecisionMixin + the scorer), loaded with trust_remote_code
      decision.json             DecisionConfig: the three temperatures, noul option order, labels
      decision_template.jinja   rlcd's prompt as a decision template (rlcd.hf.template)
      tokenizer.json, tokenizer_config.json, tokenization_rlcd.py (restores ignore_merges), ...
      README.md                 the model card, from eval/evaluation.json

It is written from the export artefact rebuilt on the CPU in float32 (what `rlcd predict` runs), so
`pipeline("decision", model="export/hf", trust_remote_code=True)` gives `rlcd predict`'s probabilities.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from rlcd.files import plain_mode
from rlcd.hf import modeling_rlcd
from rlcd.hf.template import decision_template

HERE = Path(__file__).resolve().parent
AUTO_MAP = {"AutoConfig": "modeling_rlcd.RlcdDecisionConfig", "AutoModelForDecision": "modeling_rlcd.RlcdForDecision"}
MAX_OPTIONS = 255


def decision_config(meta: Mapping[str, Any], marker: str, head: str = "") -> Any:
    """transformers' DecisionConfig of an rlcd model: its temperatures, rlcd's noul order and prompt."""
    from transformers.decision import DecisionConfig

    labels = [str(i) for i in range(MAX_OPTIONS)]  # only bound the option count; rlcd's head reads no labels
    return DecisionConfig(labels={"choice": labels, "score": labels},
                          temperature={t: float(v) for t, v in meta["temperatures"].items()},
                          chat_template=decision_template(marker, head), noul_options=["false", "true"])


def _write_tokenizer(tokenizer: Any, out: Path) -> None:
    tokenizer.save_pretrained(str(out))
    base = type(tokenizer).__name__
    text = (HERE / "tokenization_rlcd.py").read_text(encoding="utf-8")
    (out / "tokenization_rlcd.py").write_text(text.replace('BASE_CLASS = "Qwen3_5Tokenizer"',
                                                           f'BASE_CLASS = "{base}"'), encoding="utf-8")
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "RlcdTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_rlcd.RlcdTokenizer"]}
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@torch.no_grad()
def write_hf_export(model: Any, meta: Mapping[str, Any], out: Path, *, evaluation: Mapping[str, Any] | None = None,
                    run_name: str = "rlcd") -> Path:
    """Write `out` (export/hf) from a merged DecisionModel on the CPU and its export metadata."""
    from rlcd.hf.card import licence_file, model_card

    if not getattr(model, "merged", False):
        raise ValueError("write_hf_export needs the merged model (DecisionModel.merge())")
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    backbone = model.causal_lm()
    head = model.head
    config = modeling_rlcd.RlcdDecisionConfig(
        backbone_class=type(backbone).__name__, backbone_config=backbone.config.to_dict(), hidden_size=head.hidden,
        proj_dim=head.proj_dim, centring=head.centring, architectures=["RlcdForDecision"], auto_map=dict(AUTO_MAP))
    with torch.device("meta"):
        hf = modeling_rlcd.RlcdForDecision(config)
    hf.backbone = backbone
    hf.w_d = torch.nn.Linear(head.hidden, head.proj_dim, bias=False)
    hf.w_c = torch.nn.Linear(head.hidden, head.proj_dim, bias=False)
    hf.w_d.weight.copy_(head.w_d.weight.float().cpu())
    hf.w_c.weight.copy_(head.w_c.weight.float().cpu())
    hf.register_buffer("mu_d", head.mu_d.float().cpu().clone())
    hf.register_buffer("mu_c", head.mu_c.float().cpu().clone())
    hf.decision_config = decision_config(meta, model.encoder.marker, model.encoder.spec.head)
    hf.save_pretrained(str(out))
    plain_mode(*out.glob("*.safetensors"))  # safetensors writes 600, the rest of export/hf is 644
    shutil.copyfile(HERE / "modeling_rlcd.py", out / "modeling_rlcd.py")
    _write_tokenizer(model.tokenizer, out)
    (out / "README.md").write_text(model_card(meta, evaluation, run_name=run_name), encoding="utf-8")
    licence = licence_file(meta.get("backbone") or {})
    if licence is not None:  # the weights' licence travels with them
        shutil.copyfile(licence, out / licence.name)
    return out


__all__ = ["write_hf_export", "decision_config"]
