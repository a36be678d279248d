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

**Canonical requests** (on by default, as `rlcd serve`): each question is asked in one canonical form and its
answer mapped back to the caller's options, with rlcd's rules (`rlcd.serving.canonical`, restated here because
the export loads without rlcd; tests hold the two to the same answers): a choice's options sorted by (description,
id), options with the same description asked once (each copy gets the asked option's probability divided by the
number of copies), a two-option choice or a two-level score meaning no/yes or false/true asked as a noul (under
the noul's temperature). `config.canonical_requests = False` -- e.g.
`pipeline("decision", model=..., trust_remote_code=True, model_kwargs={"canonical_requests": False})` -- asks
every question as sent (`rlcd serve --as-asked`).
"""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

try:
    from transformers.decision import DecisionMixin, Question
except ImportError as e:  # pragma: no cover - older transformers
    raise ImportError("this model needs transformers >= 5.23 (transformers.decision)") from e

YES_NO_MEANINGS = (("no", "yes"), ("false", "true"))  # (the false option's meaning, the true option's)
PART_TYPES = ("text", "image", "image_url")


def _text(value):
    """A description as rlcd reads it: None and strings as they are, content parts as their text parts joined, any
    other JSON value as its JSON."""
    if value is None or isinstance(value, str):
        return value
    parts = [value] if isinstance(value, dict) else value
    if isinstance(parts, list) and parts and all(isinstance(p, dict) and p.get("type") in PART_TYPES for p in parts):
        return "".join(str(p.get("text", "")) for p in parts if p["type"] == "text")
    return json.dumps(value, ensure_ascii=False)


def _yes_no(meanings):
    """Per option 1 (yes/true) or 0 (no/false) when the two meanings are exactly {no, yes} or {false, true}."""
    if len(meanings) != 2:
        return None
    for false, true in YES_NO_MEANINGS:
        if sorted(m or "" for m in meanings) == sorted((false, true)):
            return [1 if m == true else 0 for m in meanings]
    return None


def _meaning(text):
    return text.strip().casefold() if isinstance(text, str) else None


def _as_noul(question: dict) -> dict:
    return {"type": "noul", **({"instructions": question["instructions"]} if "instructions" in question else {})}


def canonical_question(question: dict):
    """(asked question, source, shares) of a request question, or None when it is asked as sent: caller option i
    is answered by asked option source[i], shared by shares[i] caller options (`rlcd.serving.canonical`)."""
    kind, criteria = question.get("type"), question.get("criteria")
    if kind == "score" and isinstance(criteria, list) and len(criteria) == 2:
        truth = _yes_no([_meaning(_text(level)) for level in criteria])
        return (_as_noul(question), truth, [1, 1]) if truth is not None else None
    if kind != "choice" or not isinstance(criteria, dict):
        return None
    labels = list(criteria)
    descs = [_text(criteria[label]) for label in labels]
    order = sorted(range(len(labels)), key=lambda i: (descs[i] if descs[i] is not None else "", labels[i]))
    kept, slot, first = [], {}, {}
    for i in order:
        if descs[i] is not None and descs[i] in first:
            slot[i] = first[descs[i]]
            continue
        slot[i] = len(kept)
        if descs[i] is not None:
            first[descs[i]] = len(kept)
        kept.append(i)
    source = [slot[i] for i in range(len(labels))]
    shares = [source.count(s) for s in source]
    truth = _yes_no([_meaning(descs[i] if descs[i] is not None else labels[i]) for i in kept])
    if truth is not None:
        return _as_noul(question), [truth[s] for s in source], shares
    if shares == [1] * len(labels) and source == list(range(len(labels))):
        return None
    return {**question, "criteria": {labels[i]: criteria[labels[i]] for i in kept}}, source, shares


class MappedQuestion:
    """An asked (canonical) question whose `answer` answers the caller's: caller option i gets
    p[source[i]] / shares[i] of the asked probabilities p."""

    def __init__(self, asked, caller, source, shares):
        self._asked, self._caller, self._source, self._shares = asked, caller, source, shares

    def __getattr__(self, name):
        return getattr(self._asked, name)

    def answer(self, probabilities):
        return self._caller.answer([probabilities[s] / n for s, n in zip(self._source, self._shares)])


def canonical_prepare(config, model):
    """`config.prepare_inputs` asking each question in its canonical form while `model.config.canonical_requests`
    (the answers mapped back by `MappedQuestion`); as sent otherwise."""
    original = config.prepare_inputs

    def prepare_inputs(request, processor):
        if not getattr(model.config, "canonical_requests", True):
            return original(request, processor)
        if isinstance(request, str):
            request = json.loads(request)
        questions = request.get("questions") if isinstance(request, dict) else None
        if not isinstance(questions, dict):
            return original(request, processor)  # transformers says what is wrong with it
        asked, maps = {}, {}
        for name, q in questions.items():
            c = canonical_question(q) if isinstance(q, dict) else None
            asked[name] = q if c is None else c[0]
            if c is not None:
                maps[name] = c
        prompts = original({**request, "questions": asked}, processor)
        out = []
        for inputs, group in prompts:
            out.append((inputs, [q if q.name not in maps else
                                 MappedQuestion(q, Question.from_request(q.name, questions[q.name], config),
                                                maps[q.name][1], maps[q.name][2]) for q in group]))
        return out

    return prepare_inputs


class RlcdDecisionConfig(PretrainedConfig):
    """The backbone's class and config, and the scorer's size and centring."""

    model_type = "rlcd_decision"
    extra_config_files: tuple = ()  # no head shipped beside another checkpoint's weights

    def __init__(self, backbone_class: str | None = None, backbone_config: dict | None = None,
                 hidden_size: int | None = None, proj_dim: int = 256, centring: str = "running_mean",
                 canonical_requests: bool = True, **kwargs):
        self.canonical_requests = bool(canonical_requests)
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

    @property
    def decision_config(self):
        """transformers' decision config, its `prepare_inputs` asking canonical forms (`canonical_prepare`)."""
        return self.__dict__.get("_rlcd_decision_config")

    @decision_config.setter
    def decision_config(self, config):
        if config is not None and not getattr(config, "_rlcd_canonical", False):
            config.prepare_inputs = canonical_prepare(config, self)
            config._rlcd_canonical = True
        self.__dict__["_rlcd_decision_config"] = config

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


__all__ = ["RlcdDecisionConfig", "RlcdForDecision", "canonical_question"]
