"""Deprecated path of `smlp_bench.micro.balanced_assignment` (issue 27), kept for one release."""
from smlp_bench.moved import moved

moved(__spec__.name, "smlp_bench.micro.balanced_assignment", main=__name__ == "__main__")
