"""`decision_template.jinja`: rlcd's prompt (rlcd.model.prompt) as a transformers decision template.

transformers' decision API renders one prompt per question with this template and tokenizes it in
one go; `<|split|>` makes the tokenizer encode the text on either side separately (as rlcd encodes
each segment on its own) and `<|mark|>` marks where the head reads (the token before it). Both are
dropped from the input ids. So the ids of a rendered prompt are exactly `PromptEncoder.encode`'s, and
the marks are its decision position and candidate (marker) positions, each + 1 (tested token for token).

Content values render as rlcd's request parser reads them: a string as is, `null` as nothing, a
content part `{"type": "text", "text": t}` (or a list of parts) as its text parts joined, any other
JSON value as JSON (`tojson` is `json.dumps(..., ensure_ascii=False)`, as `schema.text_of`).
"""

from __future__ import annotations

from rlcd.model.prompt import DEFAULT_NOUL

MARK, SPLIT = "<|mark|>", "<|split|>"


def decision_template(marker: str, head: str = "") -> str:
    """The Jinja template for a model whose candidate marker token is `marker` and whose rows open with
    `head` (`PromptSpec.head`: a text decoder's chat-template opening, special tokens parsed)."""
    return (
        "{%- macro text(x) -%}"
        "{%- if x is none -%}"
        "{%- elif x is string -%}{{ x }}"
        "{%- elif x is mapping and x.type == 'text' -%}{{ x.text }}"
        "{%- elif x is mapping and x.type in ['image', 'image_url'] -%}"
        "{%- elif x is sequence and x|length > 0 and x|selectattr('type', 'defined')|list|length == x|length -%}"
        "{%- for part in x -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"
        "{%- else -%}{{ x|tojson }}"
        "{%- endif -%}"
        "{%- endmacro -%}"
        f"{head}{SPLIT}State: {{{{ text(state) }}}}\n"
        f"{SPLIT}{{{{ question.type }}}} question: {{{{ text(question.instructions) }}}}\nOptions:\n{MARK}"
        "{%- for option in question.options -%}"
        "{%- set d = question.descriptions[loop.index0] -%}"
        "{%- if question.type == 'choice' -%}"
        "{%- set line = option if d is none else option ~ ': ' ~ text(d) -%}"
        "{%- elif question.type == 'noul' -%}"
        f"{{%- set line = option ~ ': ' ~ (text(d) if d is not none else {DEFAULT_NOUL!r}[option]) -%}}"
        "{%- else -%}"
        "{%- set line = 'level ' ~ loop.index0 ~ ': ' ~ text(d) -%}"
        "{%- endif -%}"
        f"{SPLIT}- {{{{ line }}}}{marker}{MARK}{{{{ '\\n' }}}}"
        "{%- endfor -%}"
    )


__all__ = ["decision_template", "MARK", "SPLIT"]
