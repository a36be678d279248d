"""Training: the fixed recipe's loop, its setup, DDP, dev selection and the run writer.

One file per job (follow one update / one run's setup in docs/ARCHITECTURE.md):

    inputs.py       config.json + samples.json of a new run, resume checks, the --init source (nothing written)
    setup.py        a new run / resume / --init -> a ready Trainer (build_session, init_centring)
    sources.py      where (h_dec, h_cand) come from: the live backbone or the feature cache (SourcePlan)
    session.py      Session.update: one optimizer update (sample, forward, objective, backward, step)
    selection.py    dev_accuracy, improves_on, patience: the dev evaluation and checkpoint selection
    writer.py       TrainState (state.json), RunWriter (metrics.jsonl, tracker, checkpoints; rank 0 only)
    loop.py         train() = setup + fit(): the loop
    distributed.py  Dist, init/finish_distributed, exit_torchrun_rank, local_accum, micro_indices, reduce_stats (DDP)
"""

from .distributed import (Dist, exit_torchrun_rank, finish_distributed, init_distributed, local_accum, micro_indices,
                          reduce_stats)
from .inputs import (DATA_FILES, ResumeRefused, check_data_dir, data_hashes, git_revision, init_source,
                     library_versions, load_init_weights, new_run)
from .loop import fit, log_due, train
from .selection import dev_accuracy, improves_on, patience_exhausted
from .session import Session, TrainingDiverged, noise_generator
from .setup import Trainer, build_session, check_rows, init_centring, setup
from .sources import CachedFeatures, LiveSource, SourcePlan, plan_sources
from .writer import RunWriter, TrainState

__all__ = ["DATA_FILES", "CachedFeatures", "Dist", "LiveSource", "ResumeRefused", "RunWriter", "Session",
           "SourcePlan", "TrainState", "Trainer", "TrainingDiverged", "build_session", "check_data_dir",
           "check_rows", "data_hashes", "dev_accuracy", "fit", "git_revision", "improves_on",
           "exit_torchrun_rank", "finish_distributed", "init_centring", "init_distributed", "init_source",
           "library_versions", "load_init_weights",
           "local_accum", "log_due", "micro_indices", "new_run", "noise_generator", "patience_exhausted",
           "plan_sources", "reduce_stats", "setup", "train"]
