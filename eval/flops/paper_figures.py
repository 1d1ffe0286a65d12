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

__all__ = ["TABLE3_DIMS", "TABLE3_ROWS", "PaperModel", "PAPER_MODELS", "SMALL_SMLP", "LARGE_SMLP", "TABLE5",
           "Table5Row", "MATCH_TOLERANCE"]

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


# ---------------------------------------------------------------- Table 5 as printed

MATCH_TOLERANCE = 0.03  # a derived FLOPs figure "matches" the paper's within 3% (its figures have 2 digits)


@dataclass(frozen=True)
class Table5Row:
    """One row of Table 5 as printed: FLOPs (T) and model size (B parameters, all GPUs), and why ours differ."""

    name: str
    arch: str
    flops_T: float
    size_B: float
    cause: str = ""  # why our count of the printed architecture differs, where it does


_ONE_MORE_SPARSE_LAYER = "ours plus one more sparse layer of 32 FFN experts (32 x 33.6M = 1.07B)"

TABLE5 = (
    Table5Row("GShard", "gshard_lm_paper_large", 2.0, 9.03,
              "FLOPs: top-2 routing runs every token through two FFN experts in each of the 7 sparse layers "
              "(+0.48T over top-1); the printed 7 + 7 stack costs 1.78T with one expert per token and 2.26T with "
              "two, so 2.0T is neither. Size: the printed 9.03B equals Switch's, i.e. 32 experts; with the printed "
              "64 experts (two per GPU) the experts alone are twice Switch's"),
    Table5Row("Switch Transformer", "switch_lm_paper_large", 2.0, 9.03,
              "FLOPs: the printed 7 + 7 stack with one FFN expert per token costs 1.78T; 2.0T is the cost of "
              "8 + 8 (the Switch - Enlarge and Base Layers stacks). Size: " + _ONE_MORE_SPARSE_LAYER
              + " is 9.17B, 1.5% from the printed 9.03B"),
    Table5Row("Switch Transformer - Enlarge", "switch_enlarge_lm_paper_large", 2.3, 10.31,
              "FLOPs: the printed 8 + 8 stack costs 2.00T, as Base Layers' 8 + 8; 9 + 9 would cost 2.23T. "
              "Size: the printed figure is " + _ONE_MORE_SPARSE_LAYER),
    Table5Row("Base Layers", "base_layers_lm_paper_large", 2.0, 10.31,
              "FLOPs match. Size: Table 10 prints this model as 268.6M expert parameters per GPU + 642.6M "
              "non-expert = 9.24B on 32 GPUs, which we reproduce; the printed 10.31B is " + _ONE_MORE_SPARSE_LAYER),
    Table5Row("HASH Layers", "hash_layers_lm_paper_large", 2.0, 10.29,
              "FLOPs match. Size: " + _ONE_MORE_SPARSE_LAYER + " is 10.31B, 0.2% from the printed 10.29B"),
    Table5Row("sMLP-deterministic", "smlp_lm_paper_large", 2.0, 9.41,
              "FLOPs: Table 10 gives the same model 2.125T, which we reproduce; Table 5's 2.0T is the matching "
              "target rather than this model's count. Size matches"),
)
