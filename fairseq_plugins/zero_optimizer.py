"""Optimizer-state sharding (ZeRO stage 1, fairseq's --zero-sharding os) for expert-parallel models.

fairseq wraps the whole optimizer in fairscale's OSS: each rank keeps the optimizer state of a
1/W share of the parameters, steps only that share and broadcasts the updated weights. That is
right for parameters every rank holds the same copy of, and wrong for expert parameters: rank r's
experts are not rank r''s, so the rank owning an expert tensor's share would overwrite every
other rank's experts with its own. `ExpertLocalOSS` keeps the two apart:

- non-expert parameters: fairscale's OSS over the data-parallel group (their Adam moments are
  split over the W ranks);
- expert parameters: the same optimizer class, local to the rank (their moments stay with the
  experts; replicas of expert-data parallelism receive the same averaged gradients and stay equal).

Checkpoints keep the unsharded format: `state_dict()` returns the state of every parameter in the
order fairseq built the optimizer (the non-expert share of every rank gathered on every rank,
since each rank writes its own shard when the model has experts), and `load_state_dict` takes
such a state and keeps this rank's share. A run can therefore resume with or without
--zero-sharding, and on another world size (fairseq_plugins.elastic reshards the moments).

`install()` replaces `fairseq.optim.shard_`, which the trainer calls for --zero-sharding os; models
without expert parameters get fairseq's own OSS wrapper.
"""
from __future__ import annotations

import copy
import logging

import torch

from smlp.experts import is_expert

logger = logging.getLogger(__name__)

__all__ = ["ExpertLocalOSS", "install"]


class ExpertLocalOSS(torch.optim.Optimizer):
    """fairscale OSS for the non-expert parameters, a local optimizer for the expert ones (module docstring).

    A torch Optimizer (fairseq checks) whose param_groups are the two inner optimizers' own groups."""

    disable_mem_eff_fp16_loading_hack = True  # as fairseq's FairseqOSS

    def __init__(self, param_groups, optim_cls, group=None, **defaults):
        from fairscale.optim import OSS

        param_groups = list(param_groups)
        self._optim_cls = optim_cls
        self._order = [p for g in param_groups for p in g["params"]]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        shared = [{**h, "params": [p for p in g["params"] if not is_expert(p)]} for h, g in zip(hyper, param_groups)]
        experts = [{**h, "params": [p for p in g["params"] if is_expert(p)]} for h, g in zip(hyper, param_groups)]
        shared = [g for g in shared if g["params"]]
        experts = [g for g in experts if g["params"]]
        if not experts:
            raise ValueError("ExpertLocalOSS is for models with expert parameters; use fairscale's OSS otherwise")
        self.oss = OSS(shared, optim=optim_cls, group=group, **defaults) if shared else None
        self.local = optim_cls(experts, **defaults)
        super().__init__([{"params": list(self._order)}], dict(defaults))
        # fairseq sets the learning rate through param_groups: they are the two optimizers' own dicts
        self.param_groups = (self.oss.param_groups if self.oss else []) + self.local.param_groups
        self._shared_order = [p for g in shared for p in g["params"]]
        self._expert_order = [p for g in experts for p in g["params"]]

    def __getattr__(self, name):
        cls = self.__dict__.get("_optim_cls")
        if name.startswith("supports") and cls is not None and hasattr(cls, name):  # supports_memory_efficient_fp16
            return getattr(cls, name)
        raise AttributeError(f"'ExpertLocalOSS' object has no attribute {name!r}")

    # ------------------------------------------------------------------ training

    def step(self, closure=None):
        loss = self.oss.step(closure) if self.oss else None
        local = self.local.step(closure if self.oss is None else None)
        return loss if self.oss else local

    def zero_grad(self, set_to_none: bool = True):
        if self.oss:
            self.oss.zero_grad(set_to_none=set_to_none)
        self.local.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the non-expert share of every rank on EVERY rank: each rank writes its own checkpoint
        shard (expert models), and every shard holds the whole optimizer state (a collective)."""
        if self.oss:
            self.oss.consolidate_state_dict(recipient_rank=-1)

    def state_dict(self) -> dict:
        """The unsharded torch format: one entry per parameter, in fairseq's order."""
        index = {id(p): i for i, p in enumerate(self._order)}
        state = {}
        groups = []
        for opt, order in ((self.oss, self._shared_order), (self.local, self._expert_order)):
            if opt is None:
                continue
            sd = opt.state_dict()
            for j, entry in sd["state"].items():
                state[index[id(order[j])]] = entry
            for g in sd["param_groups"]:
                groups.append({**{k: v for k, v in g.items() if k != "params"},
                               "params": [index[id(order[j])] for j in g["params"]]})
        merged = {}
        for g in groups:  # fairseq built one group: merge back groups with the same hyper-parameters
            key = repr(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
            merged.setdefault(key, {**g, "params": []})["params"].extend(g["params"])
        out_groups = [{**g, "params": sorted(g["params"])} for g in merged.values()]
        return {"state": state, "param_groups": out_groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take an unsharded state (fairseq's parameter order); keep the non-expert share of this rank."""
        flat = [i for g in state_dict["param_groups"] for i in g["params"]]
        if sorted(flat) != list(range(len(self._order))):
            raise ValueError(f"the optimizer state holds {len(flat)} parameter(s) but this model has "
                             f"{len(self._order)}: it is not this model's optimizer state")
        hyper = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
        index = {id(p): i for i, p in enumerate(self._order)}
        for opt, order in ((self.oss, self._shared_order), (self.local, self._expert_order)):
            if opt is None:
                continue
            if len(opt.param_groups) != 1:
                raise ValueError("ExpertLocalOSS restores optimizers built with one parameter group (as fairseq's)")
            mine = [index[id(p)] for p in order]
            # copies: OSS.load_state_dict empties the entries of parameters another rank owns
            sub = {"state": {j: copy.copy(state_dict["state"][i]) for j, i in enumerate(mine)
                             if i in state_dict["state"]},
                   "param_groups": [{**hyper, "params": list(range(len(mine)))}]}
            opt.load_state_dict(sub)

    def broadcast_global_state_dict(self, state_dict):
        return state_dict  # every rank loads its own checkpoint shard (expert models): nothing to broadcast


def install() -> None:
    """Route --zero-sharding os through ExpertLocalOSS when the model has expert parameters (idempotent)."""
    from fairseq import optim
    from fairseq.optim import shard as fairseq_shard

    if getattr(optim.shard_, "_smlp", False):
        return
    original = fairseq_shard.shard_

    def shard_(optimizer, group):
        torch_optimizer = optimizer.optimizer
        params = [p for g in torch_optimizer.param_groups for p in g["params"]]
        if not any(is_expert(p) for p in params):
            return original(optimizer, group)
        optimizer.optimizer = ExpertLocalOSS(torch_optimizer.param_groups, type(torch_optimizer), group=group,
                                             **optimizer.optimizer_config)
        shared = sum(p.numel() for p in params if not is_expert(p))
        logger.info("--zero-sharding os: the optimizer state of %d non-expert parameters is split over the ranks; "
                    "the %d expert parameters keep theirs on their rank", shared,
                    sum(p.numel() for p in params if is_expert(p)))

    shard_._smlp = True
    optim.shard_ = shard_
