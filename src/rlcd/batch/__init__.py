"""Batch scoring: `rlcd predict RUN --input FILE --output FILE` in one process, or on a Ray cluster (`--ray`).

`io` owns the files (input read in order, output committed in atomic parts, resume, rejects), `local` the
scoring core and the one-process loop, `ray` the same job through Ray Data (`predict_dataset` for users'
own pipelines). All of them answer through `rlcd.predict.Predictor` (prepare, score_many, respond).
"""
