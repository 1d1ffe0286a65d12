"""Deprecated path: HyperMixer moved to smlp.hypermixer, NiNformer to smlp.ninformer, TOKEN_MIXERS to
smlp.gmlp and make_token_mixer to smlp.lm (this name works for one more release)."""
from .deprecation import warn_moved
from .gmlp import TOKEN_MIXERS
from .hypermixer import CHUNK_ELEMENTS, HyperMixerConfig, HyperMixingUnit, hypermixing, hypermixing_step
from .lm import make_token_mixer
from .ninformer import CausalTokenMLP, MixerSubUnit, NiNformerConfig, NiNformerGatingUnit

__all__ = ["TOKEN_MIXERS", "CHUNK_ELEMENTS", "HyperMixerConfig", "NiNformerConfig", "hypermixing", "hypermixing_step",
           "HyperMixingUnit", "CausalTokenMLP", "MixerSubUnit", "NiNformerGatingUnit", "make_token_mixer"]

warn_moved(__name__, "smlp.hypermixer, smlp.ninformer (TOKEN_MIXERS: smlp.gmlp, make_token_mixer: smlp.lm)")
