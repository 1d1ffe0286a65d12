"""sMLP core: token mixers, routers, dispatchers, experts and MoE layers in pure PyTorch.

Implements "Efficient Language Modeling with Sparse all-MLP" (Yu et al. 2022). No fairseq
import here: the fairseq registrations live in `fairseq_plugins/`.
"""
