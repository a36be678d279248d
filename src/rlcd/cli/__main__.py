"""`python -m rlcd.cli ...` (and `torchrun -m rlcd.cli train ...`)."""

from rlcd.cli import main

main()
