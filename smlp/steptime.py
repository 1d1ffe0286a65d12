"""Step-time model: communication, memory and time of one training update at paper scale.

From a model's FLOPs and parameters (eval/flops/counting.py), `Training` and a `Cluster`, with no
overlap of communication and compute, as legacy_ddp runs (docs/scale-out.md), an update takes

    U x [ 3 B x FLOPs per sequence / (peak x matmul efficiency)   forward + backward
          + B x blocks' forward FLOPs / (peak x efficiency)   --checkpoint-activations: recomputed
          + 4 x activation bytes / HBM bandwidth        memory-bound: each saved byte and its
                                                        gradient are written and read (recomputing:
                                                        the kept inputs read once more)
          + all2all time not hidden by the experts ]    per exchange: latency + max(NVLink, IB time)
    + gradient all-reduces + optimizer (about 32 bytes of HBM traffic per parameter)

with W ranks, G per expert-parallel group, B sequences per GPU, U micro-batches per update. Routing
is taken as balanced, so (G-1)/G of every all2all's bytes cross a link. Left out, and so reasons the
paper's measured Table 4 can differ: load imbalance, Base Layers' auction, kernel launches, data loading.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from smlp.lm import LMConfig
from smlp.routing.registry import TOKEN_ROUTERS

__all__ = ["Cluster", "CLUSTERS", "GPU_CLUSTERS", "Training", "Exchange", "sparse_exchanges",
           "a2a_seconds", "expert_seconds", "exposed_a2a_seconds", "allreduce_seconds", "allreduce_payloads",
           "memory_per_gpu", "activation_bytes_per_micro_batch", "step_time", "StepTime", "SMOE_LAYOUTS",
           "smoe_expert_params", "padding_macs_per_sequence", "with_cluster_overrides", "layout_seconds",
           "choose_smoe_layout"]

SMOE_LAYOUTS = ("expert", "replicated")  # the sMoE's parallel layouts (fairseq's --smoe-parallel)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A GPU cluster as the step-time model sees it (bandwidths per direction)."""

    name: str
    gpus_per_node: int
    peak_flops: float          # dense tensor-core peak per GPU at the training precision (FLOP/s)
    matmul_efficiency: float   # fraction of the peak the model's matmuls reach
    hbm_bandwidth: float       # bytes/s per GPU
    gpu_memory: float          # bytes per GPU
    nvlink_bandwidth: float    # bytes/s per GPU to the other GPUs of its node (all2all, effective)
    nvlink_latency: float      # seconds per collective inside a node
    ib_bandwidth: float        # bytes/s per node to other nodes (all its NICs together)
    ib_latency: float          # seconds per collective across nodes

    def __post_init__(self) -> None:
        for name in ("gpus_per_node",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        for name in ("peak_flops", "hbm_bandwidth", "gpu_memory", "nvlink_bandwidth", "ib_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency={self.matmul_efficiency!r} must be in (0, 1]")
        for name in ("nvlink_latency", "ib_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")


# The paper trained on 32 V100 32GB GPUs (appendix C). Figures for NVIDIA DGX-1 (V100 SXM2):
# 125 TFLOP/s fp16 tensor cores, 900 GB/s HBM2, NVLink2 hybrid cube-mesh (6 links x 25 GB/s, not
# every pair directly linked: ~100 GB/s effective for an all2all), 4 x 100 Gb/s EDR InfiniBand
# per node. 40% of peak is what large fp16 matmuls of fairseq reached on V100.
CLUSTERS = {
    "v100-dgx1": Cluster(name="v100-dgx1", gpus_per_node=8, peak_flops=125e12, matmul_efficiency=0.4,
                         hbm_bandwidth=900e9, gpu_memory=32 * 2 ** 30, nvlink_bandwidth=100e9, nvlink_latency=10e-6,
                         ib_bandwidth=4 * 12.5e9, ib_latency=25e-6),
    "a100-dgx": Cluster(name="a100-dgx", gpus_per_node=8, peak_flops=312e12, matmul_efficiency=0.5,
                        hbm_bandwidth=2.0e12, gpu_memory=80 * 2 ** 30, nvlink_bandwidth=250e9, nvlink_latency=8e-6,
                        ib_bandwidth=8 * 25e9, ib_latency=15e-6),
    # smlp-bench's machine, 2 single-thread gloo ranks on one host. Measured: fp32 peak 61 GFLOP/s per rank,
    # ~60% reached; all_to_all ~1.1 GB/s after ~75 us, all_reduce ~0.75 GB/s after ~150 us; copies ~3 GB/s.
    "cpu-gloo": Cluster(name="cpu-gloo", gpus_per_node=2, peak_flops=61e9, matmul_efficiency=0.6,
                        hbm_bandwidth=3e9, gpu_memory=8 * 2 ** 30, nvlink_bandwidth=1.0e9, nvlink_latency=100e-6,
                        ib_bandwidth=1.0e9, ib_latency=100e-6),
}
GPU_CLUSTERS = ("v100-dgx1", "a100-dgx")  # the presets a GPU run's default layout must agree on


@dataclass(frozen=True, kw_only=True)
class Training:
    """The training flags the step time depends on."""

    world_size: int
    ep_size: int               # G (1 for a dense model)
    batch_size: int            # sequences per GPU per micro-batch (--batch-size)
    update_freq: int = 1
    tokens: int = 1024         # tokens per sequence (--tokens-per-sample)
    fp16: bool = True
    optimizer_sharding: bool = False   # --zero-sharding os: non-expert Adam moments split over W
    padding: bool = False              # GShard / Switch send E x capacity buffers
    smoe_layout: str = "expert"        # the sMoE's experts: spread over the group, or replicated on every rank
    all2all_chunks: int = 1            # 2: each layer's rows in 2 chunks, exchanges overlapped with the experts

    def __post_init__(self) -> None:
        for name in ("world_size", "ep_size", "batch_size", "update_freq", "tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.world_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide world_size={self.world_size}")
        if self.smoe_layout not in SMOE_LAYOUTS:
            raise ValueError(f"smoe_layout={self.smoe_layout!r} is unknown: valid values are {', '.join(SMOE_LAYOUTS)}")
        if self.all2all_chunks not in (1, 2):
            raise ValueError(f"all2all_chunks={self.all2all_chunks!r} is not modelled: 1 (no overlap) or 2")

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.fp16 else 4

    @property
    def replicas(self) -> int:
        return self.world_size // self.ep_size

    @property
    def tokens_per_update(self) -> int:
        return self.world_size * self.update_freq * self.batch_size * self.tokens


# ---------------------------------------------------------------- all2all


@dataclass(frozen=True)
class Exchange:
    """One all2all of a sparse layer: `rows` rows of `row_bytes` and `extra_bytes` more put in by each rank,
    `times` per step (per micro-batch: forward dispatch + combine, backward the reverse of both)."""

    name: str
    rows: int
    row_bytes: int
    ep_size: int
    times: int = 4
    extra_bytes: int = 0  # what rides along in the same collective (Base Layers' dispatch counts)

    @property
    def bytes_in(self) -> int:
        """Bytes one rank puts into one exchange (its own share included)."""
        return self.rows * self.row_bytes + self.extra_bytes

    @property
    def bytes_sent(self) -> float:
        """Bytes that leave the GPU in one exchange: rows for the other G-1 ranks (balanced routing)."""
        return self.bytes_in * (self.ep_size - 1) / self.ep_size

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_in": self.bytes_in, "bytes_sent": self.bytes_sent,
                "bytes_sent_per_step": self.bytes_sent * self.times}


def sparse_exchanges(cfg: LMConfig, *, sequences: int, tokens: int, ep_size: int, dtype_bytes: int,
                     padding: bool = False, training: bool = True, smoe_layout: str = "expert") -> list[Exchange]:
    """The all2all exchanges of one sparse layer for one micro-batch of `sequences` x `tokens` per rank.

    sMoE: one row per sequence and gated channel, of the T - P positions the experts mix (sec. 3.2.1);
    nothing in the replicated layout. tMoE: the router registry's rows; with `padding`, Switch and
    GShard send E x capacity rows, as their usual implementations do (ours sends the rows routed).
    Base Layers' shuffle in training: each token's E fp32 scores out and its expert back, forward only; with
    the experts, each rank sends every rank of the group the counts its dispatch reads (E + E + G int64:
    `AllToAllDispatcher.unshuffle_assignment`), so the dispatch exchanges no counts of its own.
    """
    if not cfg.sparse_layers:
        return []
    S, D, E = sequences * tokens, cfg.d_model, cfg.num_experts
    row = D * dtype_bytes
    out = []
    if cfg.family == "smlp":
        smoe = cfg.sparse_block.smoe
        M = tokens - min(smoe.prefix_len, tokens)
        if smoe_layout == "expert":
            out.append(Exchange("smoe", sequences * smoe.gated_dim, M * dtype_bytes, ep_size))
        router = TOKEN_ROUTERS["base"]  # the sparse block's tMoE (SparseBlockConfig.tmoe)
    else:
        router = TOKEN_ROUTERS[cfg.moe_router]
    # rows per exchange, capacity padding and the shuffle: the router registry (smlp/routing/registry.py)
    rows = router.exchange_rows(S, E, cfg.capacity_factor, padding=padding)
    out.append(Exchange(f"tmoe-{router.name}", rows, row, ep_size))
    if router.shuffle and cfg.base_shuffle and training:  # scores there, experts back; no gradient
        out.append(Exchange("base-shuffle-scores", S, 4 * E, ep_size, times=1))
        counts = ep_size * (2 * E + ep_size) * 8 if ep_size > 1 else 0
        out.append(Exchange("base-shuffle-experts", S, 8, ep_size, times=1, extra_bytes=counts))
    return out


def a2a_seconds(ex: Exchange, cluster: Cluster) -> float:
    """One exchange: G consecutive ranks, the first min(G, gpus/node) of them on one node."""
    G = ex.ep_size
    if G == 1:
        return 0.0
    local = min(G, cluster.gpus_per_node)
    per_peer = ex.bytes_in / G
    intra, inter = (local - 1) * per_peer, (G - local) * per_peer
    t_intra = intra / cluster.nvlink_bandwidth
    t_inter = inter / (cluster.ib_bandwidth / cluster.gpus_per_node)  # every GPU of the node sends at once
    latency = cluster.ib_latency if G > local else cluster.nvlink_latency
    return latency + max(t_intra, t_inter)


def expert_seconds(cfg: LMConfig, ex: Exchange, dtype_bytes: int, cluster: Cluster) -> float:
    """Forward time of the experts between an exchange's dispatch and combine, on one GPU: the sMoE's rows
    times the M x M spatial product (the paper's convention), the tMoE's rows (slots) times the FFN."""
    if ex.name == "smoe":
        M = ex.row_bytes // dtype_bytes
        macs = ex.rows * M * M
    else:
        macs = ex.rows * 2 * cfg.d_model * cfg.d_ffn
    return 2 * macs / (cluster.peak_flops * cluster.matmul_efficiency)


def exposed_a2a_seconds(cfg: LMConfig, ex: Exchange, cluster: Cluster, *, chunks: int, dtype_bytes: int) -> float:
    """All2all time of one exchange per micro-batch (its `times` passes) that compute does not hide.

    Without chunks: all of it. With 2 chunks (dispatch.Chunks; an exchange of a dispatch and a combine,
    `times` 4) each direction is a pipeline on one link: chunk 0's rows out, then chunk 1's rows out
    beside chunk 0's experts, chunk 0's results back beside chunk 1's experts, chunk 1's results back:
    2 h + 2 max(h, x / 2) - x exposed, h one half-exchange (its latency and half the bytes), x the
    experts' time (forward x, backward 2 x)."""
    if chunks == 1 or ex.times != 4:
        return ex.times * a2a_seconds(ex, cluster)
    h = a2a_seconds(replace(ex, rows=math.ceil(ex.rows / 2)), cluster)
    x = expert_seconds(cfg, ex, dtype_bytes, cluster)
    return sum(2 * h + 2 * max(h, xd / 2) - xd for xd in (x, 2 * x))


# ---------------------------------------------------------------- all-reduce


def allreduce_seconds(payload_bytes: float, ranks: int, cluster: Cluster, *, strided: int = 1) -> float:
    """Ring all-reduce of `payload_bytes` over `ranks` ranks, `strided` apart (1: consecutive): 2 (n-1)/n
    of the payload leaves each GPU, over NVLink inside a node and InfiniBand between nodes."""
    if ranks <= 1 or payload_bytes <= 0:
        return 0.0
    per_node = max(1, min(ranks, cluster.gpus_per_node // min(strided, cluster.gpus_per_node)))
    nodes = math.ceil(ranks / per_node)
    t_intra = 2 * (per_node - 1) / per_node * payload_bytes / cluster.nvlink_bandwidth if per_node > 1 else 0.0
    t_inter = 2 * (nodes - 1) / nodes * payload_bytes / cluster.ib_bandwidth if nodes > 1 else 0.0
    latency = cluster.ib_latency if nodes > 1 else cluster.nvlink_latency
    return latency + max(t_intra, t_inter)


def allreduce_payloads(params_non_expert: int, params_expert_per_gpu: int, train: Training) -> dict:
    """Gradient bytes reduced per update: non-expert over W, expert over the R replicas (per micro-batch)."""
    g = train.dtype_bytes
    expert = params_expert_per_gpu * g if train.replicas > 1 else 0
    return {"non_expert_bytes": params_non_expert * g, "non_expert_ranks": train.world_size,
            "non_expert_bytes_sent": 2 * (train.world_size - 1) / train.world_size * params_non_expert * g,
            "expert_bytes": expert, "expert_ranks": train.replicas, "expert_reductions": train.update_freq,
            "expert_bytes_sent": 2 * (train.replicas - 1) / train.replicas * expert * train.update_freq}


# ---------------------------------------------------------------- activations


def activation_bytes_per_micro_batch(cfg: LMConfig, train: Training, activations: dict[str, tuple[int, int]]) -> int:
    """Bytes autograd keeps for one micro-batch of `train.batch_size` sequences, from (floats in the training
    dtype, other bytes) per sequence and layer kind (eval/flops/activations.py)."""
    act = 0
    for kind, layers in (("head", 1), ("dense", cfg.dense_layers), ("sparse", cfg.sparse_layers)):
        floats, other = activations.get(kind, (0, 0))
        act += layers * (floats * train.dtype_bytes + other)
    return act * train.batch_size


def memory_per_gpu(cfg: LMConfig, *, params_non_expert: int, params_expert_per_gpu: int, train: Training,
                   activations: dict[str, tuple[int, int]]) -> dict:
    """Bytes per GPU: weights + gradients (fp16 as fairseq's FP16Optimizer: 2 + 2 + fp32 master 4 +
    fp32 gradient 4; fp32: 4 + 4), Adam moments (8; the non-expert ones split over W with
    `optimizer_sharding`), activations of one micro-batch."""
    weights_grads = 12 if train.fp16 else 8
    params = params_non_expert + params_expert_per_gpu
    moments_non_expert = 8 * params_non_expert / (train.world_size if train.optimizer_sharding else 1)
    act = activation_bytes_per_micro_batch(cfg, train, activations)
    out = {"params": params, "weights_and_grads": weights_grads * params,
           "adam_moments": moments_non_expert + 8 * params_expert_per_gpu,
           "adam_moments_unsharded": 8 * params, "activations": act}
    out["total"] = out["weights_and_grads"] + out["adam_moments"] + act
    out["total_unsharded"] = out["weights_and_grads"] + out["adam_moments_unsharded"] + act
    return out


# ---------------------------------------------------------------- step time


@dataclass
class StepTime:
    name: str
    train: Training
    cluster: Cluster
    flops_per_sequence: float            # forward, the paper's convention (eval/flops/counting.py)
    padding_flops_per_sequence: float    # extra forward FLOPs of capacity padding
    exchanges: list[Exchange]
    allreduce: dict
    memory: dict
    seconds: dict = field(default_factory=dict)

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def words_per_second(self) -> float:
        return self.train.tokens_per_update / self.step_seconds

    def as_dict(self) -> dict:
        return {"name": self.name, "training": asdict(self.train), "cluster": asdict(self.cluster),
                "flops_per_sequence": self.flops_per_sequence,
                "padding_flops_per_sequence": self.padding_flops_per_sequence,
                "all2all_per_sparse_layer_per_micro_batch": [e.as_dict() for e in self.exchanges],
                "allreduce": self.allreduce, "memory_bytes": self.memory, "seconds": self.seconds,
                "step_seconds": self.step_seconds, "words_per_second": self.words_per_second}


def padding_macs_per_sequence(cfg: LMConfig, tokens: int, padding: bool) -> int:
    """Extra expert multiply-adds of capacity-padded buffers (Switch with cf > 1) beyond the rows routed."""
    if not padding or cfg.family != "transformer" or not cfg.sparse_layers:
        return 0
    rows = TOKEN_ROUTERS[cfg.moe_router].padding_rows(tokens, cfg.num_experts, cfg.capacity_factor)
    return rows * 2 * cfg.d_model * cfg.d_ffn * cfg.sparse_layers


def smoe_expert_params(cfg: LMConfig, experts: int) -> int:
    """Parameters of `experts` sMoE experts (a T x T spatial weight and a bias of T each) over all sparse
    blocks; 0 for a model without an sMoE."""
    if cfg.family != "smlp" or not cfg.sparse_layers:
        return 0
    Te = cfg.sparse_block.smoe.expert_len
    return cfg.sparse_layers * experts * (Te * Te + Te)


def smoe_local_experts(cfg: LMConfig, ep_size: int) -> int:
    """The sMoE experts a GPU holds in the expert layout: its share of the group's (all of them where the group
    does not divide them; eval/flops/one_gpu.py counts the same)."""
    N = cfg.smoe_num_experts
    return N // ep_size if N % ep_size == 0 else N


def step_time(name: str, cfg: LMConfig, *, flops_per_sequence: float, params_non_expert: int,
              params_expert_per_gpu: int, train: Training, cluster: Cluster,
              activations: dict[str, tuple[int, int]],
              recompute: tuple[float, dict[str, tuple[int, int]]] | None = None) -> StepTime:
    """The time of one update (module docstring). The parameter counts are those of the expert layout
    (eval/flops/counting.py marks every expert). With train.smoe_layout "replicated" every GPU holds
    all E sMoE experts as data-parallel parameters: no sMoE all2all and the same compute, but their
    gradients join the non-expert all-reduce and the optimizer updates them on every GPU.
    With cfg.checkpoint_activations, `recompute` is (the blocks' forward FLOPs per sequence, the activations
    the plain model keeps): backward runs that forward again (no all2all again) and keeps what it keeps."""
    if cfg.checkpoint_activations and recompute is None:
        raise ValueError("a model with checkpoint_activations needs recompute=(the blocks' forward FLOPs per "
                         "sequence, the plain model's activations): backward runs each block's forward again")
    B, U = train.batch_size, train.update_freq
    if train.smoe_layout == "replicated":
        params_expert_per_gpu -= smoe_expert_params(cfg, smoe_local_experts(cfg, train.ep_size))
        params_non_expert += smoe_expert_params(cfg, cfg.smoe_num_experts)
    pad_flops = 2 * padding_macs_per_sequence(cfg, train.tokens, train.padding)
    exchanges = sparse_exchanges(cfg, sequences=B, tokens=train.tokens, ep_size=train.ep_size,
                                 dtype_bytes=train.dtype_bytes, padding=train.padding, smoe_layout=train.smoe_layout)
    memory = memory_per_gpu(cfg, params_non_expert=params_non_expert, params_expert_per_gpu=params_expert_per_gpu,
                            train=train, activations=activations)
    ar = allreduce_payloads(params_non_expert, params_expert_per_gpu, train)
    rate = cluster.peak_flops * cluster.matmul_efficiency
    recomputed, traffic = {}, 4 * memory["activations"]
    if cfg.checkpoint_activations:  # the recomputed forward keeps the plain activations; the blocks' inputs are
        block_flops, plain = recompute  # written in forward and read by the recomputation
        inputs = activation_bytes_per_micro_batch(cfg, train, {k: v for k, v in activations.items() if k != "head"})
        recomputed = {"recompute": U * B * (block_flops + pad_flops) / rate}
        traffic = 4 * activation_bytes_per_micro_batch(cfg, train, plain) + 2 * inputs
    seconds = {
        "compute": U * 3 * B * (flops_per_sequence + pad_flops) / rate,
        **recomputed,
        "memory_bound": U * traffic / cluster.hbm_bandwidth,
        "all2all": U * cfg.sparse_layers * sum(
            exposed_a2a_seconds(cfg, e, cluster, chunks=train.all2all_chunks, dtype_bytes=train.dtype_bytes)
            for e in exchanges),
        "allreduce_non_expert": allreduce_seconds(ar["non_expert_bytes"], train.world_size, cluster),
        "allreduce_expert": U * allreduce_seconds(ar["expert_bytes"], train.replicas, cluster, strided=train.ep_size),
        "optimizer": 32 * (params_non_expert + params_expert_per_gpu) / cluster.hbm_bandwidth,
    }
    return StepTime(name, train, cluster, flops_per_sequence, pad_flops, exchanges, ar, memory, seconds)


# ---------------------------------------------------------------- Table 4


def with_cluster_overrides(cluster: Cluster, **overrides) -> Cluster:
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(cluster, **given) if given else cluster


def layout_seconds(cfg: LMConfig, train: Training, cluster: Cluster) -> dict[str, float]:
    """{layout: seconds of one update spent on what the sMoE's layout changes}: all2all, all-reduces and
    optimizer (compute and memory-bound terms are the same in both). Each such term is linear in the
    parameters and rows the layouts move, so the difference of the two is exact without the model's
    other parameters or FLOPs (one stand-in parameter keeps each all-reduce's latency in both)."""
    L = smoe_local_experts(cfg, train.ep_size)
    cfg = replace(cfg, checkpoint_activations=False)  # recomputing is the same in both layouts
    out = {}
    for layout in SMOE_LAYOUTS:
        st = step_time("", cfg, flops_per_sequence=0, params_non_expert=1,
                       params_expert_per_gpu=1 + smoe_expert_params(cfg, L), train=replace(train, smoe_layout=layout),
                       cluster=cluster, activations={})
        out[layout] = st.step_seconds - st.seconds["compute"] - st.seconds["memory_bound"]
    return out


def choose_smoe_layout(cfg: LMConfig, *, world_size: int, ep_size: int, batch_size: int | None, tokens: int,
                       device_type: str, update_freq: int = 1, margin: float = 0.1) -> tuple[str, str]:
    """The default sMoE layout of a training run (fairseq's --smoe-parallel auto) and why.

    "replicated" where the model predicts it faster on every cluster preset of the device's kind by at
    least `margin` of the expert layout's communication and optimizer time, its extra weights, gradients
    and moments within a quarter of the preset's memory; otherwise "expert", the paper's layout. The
    all2all runs once per micro-batch and the replicated weights' all-reduce once per update, so a larger
    `update_freq` favours the replicated layout."""
    E = cfg.smoe_num_experts
    if cfg.family != "smlp" or not cfg.sparse_layers:
        return "expert", "no sMoE"
    if world_size <= 1:
        return "expert", "one process holds every expert: nothing to choose"
    if E % ep_size:
        return "replicated", (f"the sMoE's {E} experts (--smoe-experts) do not spread evenly over expert-parallel "
                              f"groups of {ep_size}: every rank holds all of them")
    if not batch_size:
        return "expert", ("the sequences per micro-batch are unknown (no --batch-size): the step-time model "
                          "cannot compare the layouts; expert-parallel as the paper")
    fp16 = device_type != "cpu"
    names = ("cpu-gloo",) if device_type == "cpu" else GPU_CLUSTERS
    train = Training(world_size=world_size, ep_size=ep_size, batch_size=batch_size, tokens=tokens, fp16=fp16,
                     update_freq=update_freq)
    extra_bytes = (20 if fp16 else 16) * (smoe_expert_params(cfg, E) - smoe_expert_params(cfg, E // ep_size))
    verdicts, parts = [], []
    for name in names:
        cluster = CLUSTERS[name]
        sec = layout_seconds(cfg, train, cluster)
        if extra_bytes > cluster.gpu_memory / 4:
            verdict = "expert"
        elif sec["replicated"] < (1 - margin) * sec["expert"]:
            verdict = "replicated"
        elif sec["expert"] < (1 - margin) * sec["replicated"]:
            verdict = "expert"
        else:
            verdict = None
        verdicts.append(verdict)
        parts.append(f"{name}: expert-parallel {sec['expert'] * 1e3:.1f} ms, replicated {sec['replicated'] * 1e3:.1f} "
                     f"ms of communication and optimizer per update, replicated weights +{extra_bytes / 2 ** 20:.0f} "
                     f"MiB per rank")
    detail = "; ".join(parts)
    if verdicts[0] is not None and all(v == verdicts[0] for v in verdicts):
        return verdicts[0], f"the step-time model predicts it faster ({detail})"
    return "expert", f"the step-time model is not clear-cut ({detail}); expert-parallel as the paper"
