"""Deprecated path: the module moved to smlp_eval.flops.tables (this name works for one more release)."""
import sys

from smlp.deprecation import moved

sys.modules[__name__] = moved(__name__, "smlp_eval.flops.tables")
