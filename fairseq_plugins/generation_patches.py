"""fairseq patches for text generation with our models (fairseq-fixed 0.12.3.1), in the order `install()` applies them.

fairseq's own files are not changed: each patch replaces one module attribute, marks its wrapper
(`_smlp_patch`) so that installing twice changes nothing, and keeps the original as `__wrapped__`.

1. numpy 2 (`numpy_compat_long`): `fairseq.data.token_block_dataset` builds its block index with
   `np.compat.long`, which numpy 2 removed. Every fairseq-interactive run (and the hub's `sample`)
   goes through it (`LanguageModelingTask.build_dataset_for_inference`, break mode "eos") and died
   with `AttributeError: module 'numpy' has no attribute 'compat'`. The patch gives that module
   (only it) a numpy whose `compat.long` is int64, what numpy 1 meant by it.

2. Per-rank checkpoint sets on one process (`per_rank_checkpoints`): fairseq-interactive,
   fairseq-generate and `from_pretrained` load `--path X.pt` with
   `checkpoint_utils.load_model_ensemble_and_task`, which fails ("Model file not found") when the
   expert-parallel run wrote only its rank shards `X-rank-R.pt`. As smlp-zeroshot does
   (`checkpoints.read_checkpoint_any_layout`), a missing `X.pt` whose shards form one complete save
   is loaded with its experts merged in memory; an incomplete or mixed set is refused by name. An `X.pt`
   beside shards of another save (`smlp-consolidate X.pt`, then training went on) is refused naming both
   (`checkpoints.check_current`), as by smlp-zeroshot, smlp-generate and smlp-export.

3. Generation limits and the routing prefix (`language_modeling_inference`), in
   `LanguageModelingTask.inference_step` (what fairseq-interactive, fairseq-generate and the hub's
   `generate`/`sample` call), for our models only:
   - Limits. fairseq's SequenceGenerator silently caps a hypothesis at the model's positions
     (`max_len = min(max_len_a * src_len + max_len_b, max_positions - 1)`, prompt included) and
     forces the prompt even past that cap, so a long prompt came back cut, with nothing generated.
     Here a prompt that leaves no room in the model's T positions (--seq-len, the size of its
     spatial weights), or that is as long as the --max-len-b the user gave (for language_modeling
     that length counts the prompt), stops with a ValueError naming the limit; asking for more
     than T positions logs a warning naming T, and generation stops there.
   - Partial prediction (sMLP section 3.2.2). Such a model predicts nothing from its first P
     positions (the routing prefix). A prompt whose last token sits before position P is
     left-filled with the last tokens of real text (the data folder's valid split, ending at a
     line end, read by `prefix_fill.routing_prefix_fill`; </s> repeated if the folder has
     none) using `smlp.generation.fill_prefix`, the rule smlp-zeroshot and `smlp.generation`
     use: the model reads `fill </s> prompt`. The fill goes to the decoder
     (`CoreLMDecoder.routing_prefix`), not to the generator: fairseq ends a hypothesis at every
     </s> it is made to produce, and real text holds line ends. Prompts are generated in one
     call per fill length (rows of a call share their positions); the fill is logged, never
     printed or scored, and does not count in --max-len-b.
"""
from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["install", "numpy_compat_long", "per_rank_checkpoints", "language_modeling_inference",
           "RowPlan", "plan_rows", "check_limits"]


def _mark(wrapper, original):
    wrapper._smlp_patch = True
    wrapper.__wrapped__ = original
    return wrapper


# ------------------------------------------------------------------ 1. numpy 2: np.compat.long


class _NumpyWithCompat(types.ModuleType):
    """numpy, plus the `compat.long` (int64) that numpy 2 removed; everything else is numpy's."""

    def __init__(self):
        super().__init__("numpy")
        self.compat = types.SimpleNamespace(long=np.int64)

    def __getattr__(self, name):
        return getattr(np, name)


def numpy_compat_long() -> bool:
    """Give fairseq.data.token_block_dataset a numpy with np.compat.long (see the module docstring)."""
    from fairseq.data import token_block_dataset

    current = token_block_dataset.np
    if isinstance(current, _NumpyWithCompat) or hasattr(current, "compat"):
        return False  # patched already, or numpy 1 still has it
    token_block_dataset.np = _NumpyWithCompat()
    return True


# ------------------------------------------------------------------ 2. per-rank sets on one process


def _missing_with_shards(path: str) -> bool:
    from .checkpoints import shard_paths

    if os.path.isfile(path):
        return False
    try:
        shard_paths(path)
    except FileNotFoundError:
        return False  # no shards either: fairseq's own "Model file not found"
    except ValueError:
        return True  # shards with ranks missing: read_checkpoint_any_layout names them
    return True


def per_rank_checkpoints() -> bool:
    """Let load_model_ensemble_and_task read a checkpoint saved as rank shards only (see the module docstring)."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_model_ensemble_and_task
    if getattr(original, "_smlp_patch", False):
        return False

    def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                                     num_shards=1, state=None):
        from .checkpoints import check_current

        if state is None and not suffix and num_shards == 1:
            for filename in filenames:  # a file next to newer (or older) shards of the same name: refused
                check_current(filename)
        if state is not None or suffix or num_shards != 1 or not any(_missing_with_shards(f) for f in filenames):
            return original(filenames, arg_overrides=arg_overrides, task=task, strict=strict, suffix=suffix,
                            num_shards=num_shards, state=state)
        from .checkpoints import read_checkpoint_any_layout

        ensemble, cfg = [], None
        for filename in filenames:
            merged = None
            if _missing_with_shards(filename):
                from .checkpoints import shard_paths

                merged, existing = read_checkpoint_any_layout(filename, arg_overrides)  # names missing ranks
                logger.info("%s is absent: loading its %d rank shards with the experts merged in memory "
                            "(`smlp-consolidate %s` writes the merged file once)", filename,
                            len(shard_paths(filename)), filename)
                filename = existing
            models, cfg, task = original([filename], arg_overrides=arg_overrides, task=task, strict=strict,
                                         state=merged)
            ensemble += models
        return ensemble, cfg, task

    checkpoint_utils.load_model_ensemble_and_task = _mark(load_model_ensemble_and_task, original)
    return True


# ------------------------------------------------------------------ 3. limits and routing prefix


@dataclass(frozen=True)
class RowPlan:
    """How one prompt is generated: `fill` tokens go before the `</s>` that starts it (partial
    prediction), `length` prompt tokens follow it."""

    length: int
    fill: tuple[int, ...] = ()


def plan_rows(prompt_lengths: list[int], prediction_start: int, fill_source) -> list[RowPlan]:
    """The routing-prefix fill of each prompt (none unless the model predicts from position P > 0).

    The sequence fed is `[fill] </s> prompt`; the last prompt token, at position len(fill) + n,
    predicts the first new token and must sit at position >= P (`smlp.generation.fill_prefix`,
    with first = n, as smlp-zeroshot fills a row whose first scored token is predicted from n).
    `fill_source()` gives the tokens to fill with; it is called only when a prompt needs them.
    """
    from smlp.generation import fill_prefix, prefix_fill_needed

    source = None
    plans = []
    for n in prompt_lengths:
        if prefix_fill_needed(n, prediction_start):
            source = fill_source() if source is None else source
            plans.append(RowPlan(n, tuple(fill_prefix(source, n, prediction_start))))
        else:
            plans.append(RowPlan(n))
    return plans


def check_limits(plans: list[RowPlan], *, seq_len: int, max_len_a: float, max_len_b: int, src_len: int,
                 generator_max_len: int, ids=None) -> list[str]:
    """ValueError for a prompt that cannot be generated from; the warnings to log (see the module docstring).

    fairseq's SequenceGenerator feeds `</s>` (position 0), then the prompt, then one position per new
    token, and runs one last step for the closing </s>: after a prompt of n tokens it makes max_len - n
    new tokens, max_len = min(max_len_a * src_len + max_len_b, max_positions - 1). With a routing-
    prefix fill of f tokens before the </s>, max_positions is the model's T minus f.
    """
    T = min(int(seq_len), int(generator_max_len))
    asked = int(max_len_a * src_len + max_len_b)  # tokens after </s>, prompt included (language_modeling)
    warnings = []
    for i, plan in enumerate(plans):
        name = f"prompt {ids[i] if ids is not None else i}"
        f, n = len(plan.fill), plan.length
        fill_note = f" and the {f}-token routing-prefix fill before it" if f else ""
        if n > T - f - 2:
            raise ValueError(
                f"{name} has {n} tokens: with the </s> that starts it{fill_note} it leaves no room to generate "
                f"in the model's {seq_len} positions (--seq-len, the size of its spatial weights; fairseq also "
                f"keeps one position for the closing </s>); give at most {max(T - f - 2, 0)} prompt tokens")
        if n >= asked:
            raise ValueError(
                f"{name} has {n} tokens but generation is limited to {asked} tokens after the leading </s> "
                f"(--max-len-a {max_len_a:g} x {src_len} + --max-len-b {max_len_b}; for language_modeling this "
                f"length counts the prompt): nothing would be generated and the prompt would come back cut. "
                f"Pass --max-len-b {n + 50} (prompt + 50 new tokens; at most {T - f - 1} fit in this model)")
        if asked > T - f - 1:
            warnings.append(
                f"{name}: asked for up to {asked} tokens (prompt included; --max-len-a/--max-len-b) but the model "
                f"reads at most {seq_len} positions (--seq-len, the size of its spatial weights){fill_note}: "
                f"generation stops after {T - f - 1 - n} new tokens, a hypothesis cut there has no closing </s>")
    return warnings


def _our_core(models):
    """The core LanguageModel when generating with exactly one of our models, else None."""
    from .models import CoreLMDecoder

    if len(models) != 1:
        return None
    decoder = getattr(models[0], "decoder", None)
    return decoder.core if isinstance(decoder, CoreLMDecoder) else None


def _task_prefix_fill(task, positions: int) -> list[int]:
    """The routing-prefix fill of this task's data folder (cached on the task), as smlp-zeroshot reads it."""
    cached = getattr(task, "_smlp_prefix_fill", None)
    if cached is not None and len(cached) >= positions:
        return cached
    from .prefix_fill import routing_prefix_fill

    data = str(getattr(task.args, "data", "") or "").split(os.pathsep)[0]
    dictionary = task.target_dictionary
    try:
        fill, where = routing_prefix_fill(dictionary, data or None, positions)
        what = f"the last {positions} tokens of {where} (real text ending at a line end)"
    except (FileNotFoundError, ValueError) as exc:
        fill, what = [dictionary.eos()] * positions, f"</s> repeated ({exc})"
    logger.info("partial prediction: prompts shorter than the routing prefix (%d positions) are left-filled from %s "
                "as far as needed (smlp.generation.fill_prefix, as smlp-zeroshot fills); the fill is not printed",
                positions, what)
    task._smlp_prefix_fill = fill
    return fill


def _rows_of(sample: dict, index: torch.Tensor, bsz: int) -> dict:
    """The sample restricted to rows `index` (every tensor whose first dimension is the batch)."""

    def pick(value):
        if isinstance(value, dict):
            return {k: pick(v) for k, v in value.items()}
        if torch.is_tensor(value) and value.dim() and value.shape[0] == bsz:
            return value.index_select(0, index.to(value.device))
        return value

    return pick(sample)


def language_modeling_inference() -> bool:
    """Wrap LanguageModelingTask.inference_step: limits and routing-prefix fill (see the module docstring)."""
    from fairseq.tasks.language_modeling import LanguageModelingTask

    original = LanguageModelingTask.inference_step
    if getattr(original, "_smlp_patch", False):
        return False

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        core = _our_core(models)
        if core is None or constraints is not None or not hasattr(generator, "max_len_b"):
            return original(self, generator, models, sample, prefix_tokens=prefix_tokens, constraints=constraints)
        dictionary = self.source_dictionary
        bos = dictionary.bos() if getattr(self.args, "add_bos_token", False) else dictionary.eos()
        src_tokens = sample["net_input"]["src_tokens"]
        bsz, src_len = src_tokens.shape[:2]
        if prefix_tokens is None and src_tokens.nelement():  # as the original: the source is the prompt
            prefix_tokens = src_tokens[:, 1:] if src_tokens[:, 0].eq(bos).all() else src_tokens
        lengths = ([0] * bsz if prefix_tokens is None else prefix_tokens.ne(dictionary.pad()).sum(1).tolist())
        P = int(core.cfg.prediction_start)
        plans = plan_rows(lengths, P, lambda: _task_prefix_fill(self, P))
        ids = sample["id"].tolist() if torch.is_tensor(sample.get("id")) else None
        warnings = check_limits(plans, seq_len=core.cfg.seq_len, max_len_a=generator.max_len_a,
                                max_len_b=generator.max_len_b, src_len=src_len,
                                generator_max_len=getattr(generator, "max_len", core.cfg.seq_len), ids=ids)
        for message in warnings:
            logger.warning(message)
        filled = [f"prompt {ids[i] if ids is not None else i} with {len(p.fill)}"
                  for i, p in enumerate(plans) if p.fill]
        if filled:
            logger.info("partial prediction: routing-prefix fill (tokens): %s", ", ".join(filled))
        fills = {len(p.fill) for p in plans}
        if fills == {0}:
            return original(self, generator, models, sample, prefix_tokens=prefix_tokens, constraints=None)
        decoder = models[0].decoder
        results = [None] * bsz
        with torch.no_grad():
            for f in sorted(fills):  # one generator call per fill length (rows of one call share positions)
                rows = [i for i, p in enumerate(plans) if len(p.fill) == f]
                index = torch.tensor(rows, dtype=torch.long)
                width = max(lengths[i] for i in rows)
                pre = None
                if width:
                    pre = prefix_tokens.index_select(0, index.to(prefix_tokens.device))[:, :width]
                saved = generator.max_len
                generator.max_len = min(saved, core.cfg.seq_len - f)  # the fill takes f of the T positions
                try:
                    with decoder.routing_prefix(plans[rows[0]].fill):
                        out = generator.generate(models, _rows_of(sample, index, bsz), prefix_tokens=pre,
                                                 bos_token=bos)
                finally:
                    generator.max_len = saved
                for i, hypos in zip(rows, out):
                    results[i] = hypos
        return results

    LanguageModelingTask.inference_step = _mark(inference_step, original)
    return True


# ------------------------------------------------------------------ install


def install() -> list[str]:
    """Apply every patch above, in order; returns the names of those applied now (none the second time)."""
    applied = []
    for patch in (numpy_compat_long, per_rank_checkpoints, language_modeling_inference):
        if patch():
            applied.append(patch.__name__)
    return applied
