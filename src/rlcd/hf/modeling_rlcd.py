"""rlcd typed-decision model for transformers: a decoder backbone (LoRA merged) and rlcd's candidate scorer.

Written into an rlcd export (`export/hf/`) and loaded by transformers alone, offline, with
`trust_remote_code=True` (`pipeline("decision", model="export/hf", trust_remote_code=True)` or
`AutoModelForDecision.from_pretrained`); it needs torch and transformers >= 5.23 (the decision API), not rlcd.

The decision template (`decision_template.jinja`) renders one prompt per question, exactly rlcd's
prompt: `State: ...`, `<type> question: ...\\nOptions:\\n` with a `<|mark|>` after it (the decision
position is the token before it) and one `<|mark|>` after each option's marker token (its candidate
position). `forward` reads those hidden states and scores each option with

    logit_k = (W_c (h_k - mu_c)) . (W_d (h_d - mu_d)) / sqrt(P)        (float32)

(`centring` "layernorm": parameter-free layer norm instead of the means; "none": raw features).
The per-type temperatures live in `decision.json` and are applied by transformers' decision API.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

try:
    from transformers.decision import DecisionMixin
except ImportError as e:  # pragma: no cover - older transformers
    raise ImportError("this model needs transformers >= 5.23 (transformers.decision)") from e


class RlcdDecisionConfig(PretrainedConfig):
    """The backbone's class and config, and the scorer's size and centring."""

    model_type = "rlcd_decision"
    extra_config_files: tuple = ()  # no head shipped beside another checkpoint's weights

    def __init__(self, backbone_class: str | None = None, backbone_config: dict | None = None,
                 hidden_size: int | None = None, proj_dim: int = 256, centring: str = "running_mean", **kwargs):
        self.backbone_class = backbone_class
        self.backbone_config = dict(backbone_config or {})
        self.hidden_size = hidden_size
        self.proj_dim = int(proj_dim)
        self.centring = centring
        super().__init__(**kwargs)


class RlcdForDecision(DecisionMixin, PreTrainedModel):
    """Backbone + candidate scorer; `forward(input_ids, marks, num_options)` -> the option logits."""

    config_class = RlcdDecisionConfig
    base_model_prefix = "rlcd"
    _keys_to_ignore_on_load_unexpected = [r"lm_head\\.weight"]

    def __init__(self, config: RlcdDecisionConfig):
        super().__init__(config)
        bcfg = dict(config.backbone_config)
        backbone_config = AutoConfig.for_model(bcfg.pop("model_type"), **bcfg)
        self.backbone = getattr(transformers, config.backbone_class)._from_config(backbone_config)
        h, p = int(config.hidden_size), int(config.proj_dim)
        self.w_d = nn.Linear(h, p, bias=False)
        self.w_c = nn.Linear(h, p, bias=False)
        self.register_buffer("mu_d", torch.zeros(h))
        self.register_buffer("mu_c", torch.zeros(h))
        self.post_init()

    def _init_weights(self, module):  # every weight comes from the checkpoint
        pass

    def _centre(self, h: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        if self.config.centring == "running_mean":
            return h - mu.float()
        if self.config.centring == "layernorm":
            return F.layer_norm(h, (h.shape[-1],))
        return h

    def forward(self, input_ids: torch.Tensor, marks: torch.Tensor, num_options: torch.Tensor,
                question_type_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """One prompt (batch 1) holding questions whose marks are [decision, option 1..K] each, in order.

        Returns the logits of every option of every question, concatenated (`decide` splits them).
        """
        kwargs.pop("attention_mask", None)
        core = self.backbone.model
        if hasattr(core, "rope_deltas"):
            core.rope_deltas = None  # no position offset carried over from an earlier prompt
        hidden = core(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state[0]
        marks = marks.reshape(-1).to(hidden.device)
        out, at = [], 0
        for k in num_options.reshape(-1).tolist():
            d = hidden[marks[at] - 1].float()
            c = hidden[marks[at + 1: at + 1 + k] - 1].float()
            at += 1 + k
            pd = F.linear(self._centre(d, self.mu_d), self.w_d.weight.float())
            pc = F.linear(self._centre(c, self.mu_c), self.w_c.weight.float())
            out.append(pc @ pd / math.sqrt(self.config.proj_dim))
        if at != marks.numel():
            raise ValueError(f"{marks.numel()} marks for questions of {num_options.tolist()} options: the decision "
                             "template must mark the decision position and every option")
        return torch.cat(out)


__all__ = ["RlcdDecisionConfig", "RlcdForDecision"]
