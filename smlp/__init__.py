"""sMLP core: token mixers, routers, dispatchers, experts and MoE layers in pure PyTorch.

Implements "Efficient Language Modeling with Sparse all-MLP" (Yu et al. 2022). No fairseq
import here: the fairseq registrations live in `fairseq_plugins/`.

    lm.py                  the language models (sMLP, gMLP, Transformer / Transformer-MoE) and their config
    config.py              the layers' configs (SGU, gMLP block, tMoE, sMoE, sparse block, token-routed gMLP)
    gmlp.py                the gMLP block and its Spatial Gating Unit; what the block's token mixers share
    spatial.py             the causal spatial weights: helpers, and products without the zero triangle
    hypermixer.py          the causal HyperMixer token mixer
    ninformer.py           the causal NiNformer token mixer
    transformer.py         attention and the Transformer blocks (dense FFN or a tMoE)
    moe.py                 the tMoE and sMoE layers as stages, and the sMLP sparse block
    routing/               where a row goes: the router registry, logits, rules, balanced assignment
    dispatch.py            dispatchers: move routed rows to their experts' ranks and back
    row_moves.py           the dispatchers' row moves: row permutations, the all2all begun without waiting
    comm_timer.py          the dispatchers' all2all time, measured when asked
    experts.py             FFN and spatial experts: the parameters that live on one rank
    expert_data_parallel.py  expert-parallel layouts and groups, expert gradients and their norm
    resharding.py          moving expert weights and optimizer state between layouts
    token_routed.py        gMLP with token-level routing (the paper's Appendix A experiment)
    decoding_cache.py      the cache of incremental decoding
    generation.py          greedy, sampling and beam-search generation
    precision.py           what stays out of half precision
    recompute.py           activation checkpointing: which stages run again in backward, and why not the exchanges
    flop_forms.py          the plain forms a FLOP counter traces
    profiling.py           the profiler ranges of a step and their breakdown
    process_group.py       rank, world size, the collectives' device, the ranks' object collectives
    files.py               the one atomic writer of every file (checkpoints, records, results, exports, data
                           folders): temporary file, fsync, rename, folder fsync, the mode open() gives
    third_party.py         start-up settings for third-party imports (console programs)

Shape legend, one for the whole core. A tensor's name ends in its shape (`x_SD`, `scores_SE`), as in
torchtitan's moe.py; a letter always means the same thing. A lowercase letter is a part of its
capital (n of N positions, c = C / H of an SGU head's channels); `E1` is E + 1 entries.

    Sequences
    B  sequences in a batch                  N  positions of a sequence (its length n <= T)
    T  positions a spatial weight holds       k  new positions of a decoding step; t cached after it
    P  the sMoE routing prefix (partial prediction, sMLP sec. 3.2.2): positions the router reads
    M  positions an sMoE expert mixes, n - P; m of them in a decoding step
    V  vocabulary                            Q  beams per prompt; Y = B x Q rows of a beam batch
    Widths
    D  model width; d = D / H per attention head
    F  channel-projection (FFN) width: the gMLP block's and an FFN expert's hidden width, a gating
       unit's input
    C  gated channels (F / 2, or D in the sparse block); c = C / H per SGU head, and the columns of
       one weight group of a spatial product (one expert's rows)
    H  heads (attention, multi-head SGU)    U  hidden units of a token-mixing MLP (HyperMixer's d')
    Routing and experts
    S  rows routed on this rank: tokens (tMoE) or one hidden-dimension vector per (sequence,
       channel) (sMoE); s of them in the assignment auction's working set
    K  expert slots per row (top-k: 1, or 2 for GShard)
    E  experts of a layer                     L  local experts of a rank, E / W
    W  ranks of an expert-parallel group      R  rows a rank's experts compute (received, or tiled)
    X  values each rank sends every other rank with its row counts (and a router's check verdict)
    Z  the balanced-assignment auction's key-table rows: E padded to a power of two
    Blocks of a computation
    A  batch entries of a spatial product    G  weight groups of a spatial product
    I  positions of one block or chunk (its outputs); J the positions a block reads
"""
