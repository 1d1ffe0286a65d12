"""Deprecated path of `smlp_bench.micro.harness` (issue 27: `environment` and `write_record` live there), kept for one
release."""
import sys

from smlp.deprecation import moved

sys.modules[__spec__.name] = moved(__spec__.name, "smlp_bench.micro.harness", main=__name__ == "__main__")
