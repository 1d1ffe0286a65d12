"""Deprecated path: the module moved to fairseq_plugins.zero_optimizer (this name works for one more release)."""
import sys

from smlp.deprecation import moved

sys.modules[__name__] = moved(__name__, "fairseq_plugins.zero_optimizer")
