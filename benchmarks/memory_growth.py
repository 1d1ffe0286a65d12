"""Deprecated path of `smlp_bench.micro.memory_growth` (issue 27), kept for one release."""
from smlp_bench.moved import moved

moved(__spec__.name, "smlp_bench.micro.memory_growth", main=__name__ == "__main__")
