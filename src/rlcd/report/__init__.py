"""The evaluation's outputs: evaluation.json, report.md, report.html and plots, from a run's files.

- ``evaluation``: the evaluation.json content from the prediction files (regenerable exactly);
- ``build.write_report``: both reports from the sections below, figures saved under eval/plots/;
- ``document``: the section/table/figure model and its Markdown and HTML renderers;
- ``metrics_sections``, ``error_sections``, ``run_sections``: one function per section;
- ``error_analysis``, ``training_log``, ``plots``: the data and figures those sections show;
- ``summary.format_summary``: the terminal table of `rlcd evaluate`.
"""

from rlcd.report.build import write_report
from rlcd.report.evaluation import (FORMAT, evaluation_from_predictions, evaluation_json, headline_split,
                                    load_predictions, read_jsonl, regenerate_evaluation, write_evaluation)
from rlcd.report.summary import format_summary
from rlcd.report.training_log import read_training_log

__all__ = ["FORMAT", "evaluation_from_predictions", "evaluation_json", "format_summary", "headline_split",
           "load_predictions", "read_jsonl", "read_training_log", "regenerate_evaluation", "write_evaluation",
           "write_report"]
