"""Deprecated path of `smlp_bench.micro.balanced_assignment` (issue 27), kept for one release."""
import sys

from smlp.deprecation import moved

sys.modules[__spec__.name] = moved(__spec__.name, "smlp_bench.micro.balanced_assignment", main=__name__ == "__main__")
