"""Deprecated path: the module moved to smlp.decoding_cache (this name works for one more release)."""
import sys

from .deprecation import moved

sys.modules[__name__] = moved(__name__, "smlp.decoding_cache")
