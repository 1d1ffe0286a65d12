"""Deprecated path of `smlp_bench.micro.hot_path` (issue 27), kept for one release."""
from smlp_bench.moved import moved

moved(__spec__.name, "smlp_bench.micro.hot_path", main=__name__ == "__main__")
