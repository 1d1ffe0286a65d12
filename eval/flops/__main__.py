"""`python -m smlp_eval.flops`: the smlp-flops command line."""
from .command import cli

cli()
