"""Model configurations of the sMLP paper's tables (Yu et al. 2022, sections 4.2-4.4, appendix C).

Configurations only: the widths, layer counts and experts the paper lists, as our registered
fairseq presets plus flags. The figures the paper publishes (parameters, FLOPs) live in the tests
as the paper's numbers; `smlp-flops --paper-tables` derives every figure from the real modules.

Readings (see `smlp_eval.flops` for the numbers):
- Table 3 compares token-wise operations at T=1024, D=1024, F=4096. The sMoE row is one GPU's
  share of an sMoE in the SGU position of a gMLP block (F-wide input, gated half F/2 routed to
  32 experts, one expert = one T x T spatial weight per GPU): "each expert only contains one Ws,
  which is equal to heads number 1" (section 4.2).
- Table 10's sMLP is 22 dense + 8 sparse blocks: Table 10 prints 20 dense layers and Table 5
  prints 7 sparse + 22 dense, but only 22 + 8 gives its 277.1M expert and 682.6M non-expert
  parameters (20 + 8: non-expert 7.7% off; 22 + 7: expert 12.5% off).
- Base Layers (Tables 8, 10) sparse layers are whole Transformer blocks whose FFN is the expert
  layer (attention kept, non-expert): that is the only structure that gives Table 10's 642.6M
  non-expert parameters with 8 + 8 layers (fairseq's standalone BaseLayer gives 508.3M).
  Table 8's 241.79M non-expert figure is one dense block short of its own 12 + 12 architecture
  (254.41M; 11 + 12 gives 241.81M), while its FLOPs (0.83T) and expert parameters fit 12 + 12.
  Table 10 repeats the sMLP's 2.125T for Base Layers; 8 + 8 costs 2.00T, Table 5's figure.
- Tables 8-10 print "Expert" and "Non Expert" parameters swapped for some columns (Table 9's
  sMLP, both Table 10 columns): an expert parameter count is the per-GPU share of the FFN experts
  (plus spatial weights for sMLP), which fixes which figure is which.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TABLE3_DIMS", "TABLE3_ROWS", "PaperModel", "PAPER_MODELS", "SMALL_SMLP", "LARGE_SMLP"]

# Table 3: token-wise operations.
TABLE3_DIMS = dict(seq_len=1024, d_model=1024, d_ffn=4096, num_experts=32)
# (row name, module kind, heads)
TABLE3_ROWS = (
    ("Self-attention", "attention", 16),
    ("Self-attention", "attention", 1),
    ("Spatial Gating Unit", "sgu", 16),
    ("Spatial Gating Unit", "sgu", 1),
    ("s-MoE", "smoe", 1),
)


@dataclass(frozen=True)
class PaperModel:
    """One column of Tables 5, 8, 9 or 10: a registered architecture plus flags."""

    table: str
    name: str
    arch: str
    flags: tuple[str, ...] = ()


SMALL_SMLP = PaperModel("8", "sMLP-deterministic", "smlp_lm_paper_small")
LARGE_SMLP = PaperModel("10", "sMLP-deterministic", "smlp_lm_paper_large")

PAPER_MODELS = (
    PaperModel("8", "Base Layers", "base_layers_lm_paper_small"),
    SMALL_SMLP,
    PaperModel("9", "Transformer", "transformer_lm_paper_small"),
    PaperModel("9", "gMLP", "gmlp_lm_paper_small"),
    PaperModel("10", "Base Layers", "base_layers_lm_paper_large"),
    LARGE_SMLP,
    # Table 5 (scaled-up models on 32 GPUs; GShard has 64 experts, two per GPU).
    PaperModel("5", "GShard", "gshard_lm_paper_large", ("--distributed-world-size", "32")),
    PaperModel("5", "Switch Transformer", "switch_lm_paper_large"),
    PaperModel("5", "Switch Transformer - Enlarge", "switch_enlarge_lm_paper_large"),
    PaperModel("5", "HASH Layers", "hash_layers_lm_paper_large"),
)
