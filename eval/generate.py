"""smlp-generate: text generation from our checkpoints, on one process or expert-parallel under torchrun.

    smlp-generate --path CKPT [--prompts FILE | -] [--max-new-tokens 40] [--beam K]
                  [--sample --temperature 0.8 --top-k 40 --seed 1] [--batch-size 16]
                  [--data-dir DATA_BIN] [--prefix-fill text|eos] [--output-json FILE]
    torchrun --nproc_per_node W -m smlp_eval.generate --path CKPT ...      (expert-parallel)

Each line of the prompts file (stdin by default) is one prompt. Text becomes ids through the
project's encoder (the data folder's spm.model and dict.txt, as smlp-zeroshot), a prompt starts
with </s> as every line of the training data does, and decoding runs with the core's cache
(`smlp.generation.generate`: greedy, beam search, or sampling with temperature / top-k). A
continuation ends at </s> (a line end) or after --max-new-tokens tokens; with --multiline </s> is
a line break and the text goes on.

Checkpoints: a consolidated file (smlp-consolidate) or the rank shards of an expert-parallel run
(`CKPT-rank-R.pt`, given as CKPT): on one process the shards are merged in memory, on W ranks each
rank keeps its slice of the experts (`fairseq_plugins.checkpoints.load_for_eval`).

Expert parallelism (sMLP section 3: every sMoE/tMoE layer exchanges rows between the ranks of
its expert-parallel group, in every forward call). Prompts are dealt round-robin to the ranks,
which generate their own prompts in batches; rows finish at different steps and ranks hold
different numbers of rows and batches. So that every exchange has all its ranks:
    1. before each model call a rank all-reduces (max) a flag "I still generate" = 1;
    2. a rank whose prompts are all done keeps answering with flag 0 and, while the maximum is 1,
       makes an empty step (`model(tokens[:0], cache=cache)`: it joins the expert exchanges and
       reads no position, smlp/decoding_cache.py);
    3. when the maximum is 0 every rank is done; the continuations are all-gathered and rank 0
       prints them in the order of the prompts.
Every rank therefore makes the same number of model calls (reported as `steps`), and the output
equals one process holding every expert (greedy and beam search; eval-mode routing is per token,
so a row's result does not depend on the batch it is in). Sampling draws each prompt's tokens
from its own generator seeded with --seed + the prompt's index, one prompt per call, so samples
do not depend on the number of ranks either.

Limits: a prompt plus --max-new-tokens must fit the model's T positions (--seq-len, the size of
its spatial weights); otherwise the run stops before any work with an error naming the prompt
and the number of tokens that fit. Partial-prediction models (section 3.2.2) predict nothing from
their first P positions: shorter prompts are left-filled as smlp-zeroshot does (--prefix-fill text,
the end of the data folder's valid split; `smlp.generation.fill_prefix`), which is said on stderr.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from smlp.process_group import rank_and_world

from .files import check_output_path

PROG = "smlp-generate"

__all__ = ["main", "build_parser", "Lockstep", "read_prompts", "generate_lockstep"]


class Lockstep:
    """The core LanguageModel, with one all-reduce before each call so that the ranks of an
    expert-parallel group make the same number of calls (algorithm in the module docstring)."""

    def __init__(self, core, group=None, device=None):
        self.core, self.group = core, group
        self.device = device if device is not None else torch.device("cpu")
        self.calls = 0
        self.distributed = rank_and_world(group)[1] > 1

    def __getattr__(self, name):  # cfg, training, parameters, new_cache: the core's
        return getattr(self.core, name)

    def _others_active(self, active: bool) -> bool:
        flag = torch.tensor([1 if active else 0], dtype=torch.long, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def __call__(self, tokens, cache=None):
        if self.distributed:
            self._others_active(True)
        self.calls += 1
        return self.core(tokens, cache=cache)

    def drain(self) -> None:
        """Empty steps until every rank is done (this one is)."""
        if not self.distributed:
            return
        cache = self.core.new_cache()
        empty = torch.zeros(0, 1, dtype=torch.long, device=next(self.core.parameters()).device)
        with torch.no_grad():
            while self._others_active(False):
                self.calls += 1
                self.core(empty, cache=cache)


def read_prompts(source: str) -> list[str]:
    """One prompt per line of a file, or of stdin for '-' (a trailing newline ends the last line). Reading a
    terminal, it says so first: without a prompt the program would wait without a word."""
    if source == "-" and sys.stdin.isatty():
        print(f"{PROG}: reading prompts from standard input, one per line; end with Ctrl-D (or pass --prompts "
              f"FILE, or pipe them in)", file=sys.stderr, flush=True)
    text = sys.stdin.read() if source == "-" else open(source, encoding="utf-8").read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def our_core(model, path: str):
    """The core LanguageModel of a loaded checkpoint, in eval mode; ValueError naming the model when the
    checkpoint holds another (fairseq's own transformer_lm): decoding here runs the core's cache."""
    from fairseq.models import MODEL_REGISTRY

    from smlp.lm import LanguageModel

    core = getattr(model, "core", None)
    if isinstance(core, LanguageModel):
        return core.eval()
    name = next((n for n, cls in MODEL_REGISTRY.items() if cls is type(model)), type(model).__name__)
    raise ValueError(f"{path} holds a {name} model, not one of this project's (smlp_lm, gmlp_lm, moe_transformer_lm) "
                     f"whose cached decoding {PROG} runs; generate with fairseq's own models through "
                     f"fairseq-interactive --path {path}")


def check_fits(prompts_ids: Sequence[Sequence[int]], max_new_tokens: int, seq_len: int, prediction_start: int) -> None:
    """ValueError before any work when a prompt (with its routing-prefix fill) plus the new tokens
    exceeds the model's positions (`smlp.generation` would refuse it too, but only on its rank)."""
    from smlp.generation import prefix_fill_needed

    for i, ids in enumerate(prompts_ids):
        n = len(ids) + prefix_fill_needed(len(ids) - 1, prediction_start)
        if n + max_new_tokens - 1 > seq_len:
            fits = seq_len + 1 - n
            raise ValueError(
                f"prompt {i} has {len(ids) - 1} tokens (plus the </s> that starts it"
                f"{' and its routing-prefix fill' if n > len(ids) else ''}): with --max-new-tokens {max_new_tokens} "
                f"it needs {n + max_new_tokens - 1} positions but the model has {seq_len} (--seq-len, the size of its "
                f"spatial weights); " + (f"use --max-new-tokens {fits} or less" if fits >= 1 else
                                         f"shorten it to at most {seq_len - (n - len(ids)) - 1} tokens"))


def generate_lockstep(core, prompts_ids: list[list[int]], *, max_new_tokens: int, eos: int | None, beam: int = 1,
                      sample: bool = False, temperature: float = 1.0, top_k: int = 0, seed: int = 1,
                      batch_size: int = 16, prefix_fill=None) -> tuple[list[list[int]], int]:
    """Every prompt's new tokens, and the number of model calls this rank made (the same on every rank).

    Under an initialized process group the prompts are dealt to the ranks and the results gathered
    (module docstring); every rank must call this with the same arguments.
    """
    from smlp.generation import generate

    from .scoring import collective_device, world

    rank, world_size = world()
    model = Lockstep(core, device=collective_device() if world_size > 1 else None)
    mine = list(range(rank, len(prompts_ids), world_size))
    results: dict[int, list[int]] = {}
    kwargs = dict(eos=eos, prefix_fill=prefix_fill)
    with torch.no_grad():
        if sample:  # one prompt per call, its own generator: draws independent of batches and ranks
            for i in mine:
                g = torch.Generator(device=next(core.parameters()).device).manual_seed(seed + i)
                results[i] = generate(model, [prompts_ids[i]], max_new_tokens, sample=True, temperature=temperature,
                                      top_k=top_k, generator=g, **kwargs)[0]
        else:
            for k in range(0, len(mine), batch_size):
                batch = mine[k:k + batch_size]
                outs = generate(model, [prompts_ids[i] for i in batch], max_new_tokens, beam_size=beam, **kwargs)
                results.update(zip(batch, outs))
        model.drain()
    if world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (results, model.calls))
        steps = {calls for _, calls in gathered}
        if len(steps) != 1:  # the lockstep is broken: a bug, not a user error
            raise RuntimeError(f"ranks made different numbers of model calls: {sorted(steps)}")
        for part, _ in gathered:
            results.update(part)
    return [results[i] for i in range(len(prompts_ids))], model.calls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="checkpoint (consolidated, or the name of a set of rank shards)")
    p.add_argument("--prompts", default="-", help="file with one prompt per line ('-': stdin, the default)")
    p.add_argument("--data-dir", default=None, help="binarized data folder (dict.txt, spm.model); default: the "
                                                   "one recorded in the checkpoint")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated after each prompt (40)")
    p.add_argument("--beam", type=int, default=1, help="beam size (1: greedy)")
    p.add_argument("--sample", action="store_true", help="sample instead of taking the most likely token")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=1, help="sampling seed (prompt i uses seed + i)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per batch on each rank (greedy, beam)")
    p.add_argument("--multiline", action="store_true",
                   help="do not stop at </s>: it is a line break, and the text goes on for --max-new-tokens")
    p.add_argument("--prefix-fill", choices=("text", "eos"), default="text",
                   help="partial prediction: what precedes prompts shorter than the routing prefix")
    p.add_argument("--output-json", default=None, help="also write the prompts and continuations here")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per rank")
    return p


def run(args) -> dict:
    from fairseq_plugins.prefix_fill import routing_prefix_fill

    from .scoring import world
    from .zeroshot import init_distributed, load_model

    for name in ("max_new_tokens", "beam", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.sample and args.beam > 1:
        raise ValueError("--sample draws one continuation per prompt; it does not combine with --beam > 1")
    if args.output_json:
        check_output_path(args.output_json, "--output-json")
    prompts = read_prompts(args.prompts)
    if not prompts:
        raise ValueError(f"no prompts in {'stdin' if args.prompts == '-' else args.prompts}: give one per line")
    device = init_distributed(args.device, args.threads)
    rank, world_size = world()
    t0 = time.time()
    model, _, encoder = load_model(args.path, args.data_dir, device)
    core = our_core(model, args.path)
    T, P = core.cfg.seq_len, core.cfg.prediction_start
    ids = [[encoder.eos, *encoder.encode_ids(text)] for text in prompts]
    check_fits(ids, args.max_new_tokens, T, P)
    fill, fill_note = None, None
    if P:
        if args.prefix_fill == "text":
            fill, source = routing_prefix_fill(encoder.dictionary, encoder.data_dir, P)
            fill_note = f"the last {P} tokens of {source}"
        else:
            fill, fill_note = [encoder.eos] * P, "</s> repeated (--prefix-fill eos)"
        short = sum(1 for x in ids if len(x) - 1 < P)
        if short and rank == 0:
            print(f"{PROG}: partial prediction: {short} prompt(s) shorter than the routing prefix ({P} of {T} "
                  f"positions) are left-filled with {fill_note} (smlp.generation.fill_prefix, as smlp-zeroshot)",
                  file=sys.stderr)
    t1 = time.time()
    outs, steps = generate_lockstep(core, ids, max_new_tokens=args.max_new_tokens,
                                    eos=None if args.multiline else encoder.eos, beam=args.beam,
                                    sample=args.sample, temperature=args.temperature, top_k=args.top_k,
                                    seed=args.seed, batch_size=args.batch_size, prefix_fill=fill)
    seconds = time.time() - t1
    results = []
    for text, prompt_ids, new in zip(prompts, ids, outs):
        whole = encoder.decode_ids(prompt_ids + new)
        head = encoder.decode_ids(prompt_ids)
        continuation = whole[len(head):] if whole.startswith(head) else encoder.decode_ids(new)
        results.append({"prompt": text, "continuation": continuation, "prompt_tokens": len(prompt_ids) - 1,
                        "tokens": new})
    record = {
        "checkpoint": args.path, "world_size": world_size, "steps": steps, "seconds": round(seconds, 3),
        "load_seconds": round(t1 - t0, 3),
        "settings": {"max_new_tokens": args.max_new_tokens, "multiline": args.multiline, "beam": args.beam,
                     "sample": args.sample,
                     "temperature": args.temperature, "top_k": args.top_k, "seed": args.seed,
                     "batch_size": args.batch_size, "routing_prefix": P, "prefix_fill": fill_note},
        "results": results,
    }
    if rank == 0:
        for i, r in enumerate(results):
            continuation = r["continuation"].replace("\n", "\n     ")
            print(f"[{i}] {r['prompt']}\n  -> {continuation}")
        print(f"{PROG}: {len(results)} prompt(s), {sum(len(r['tokens']) for r in results)} new tokens in "
              f"{seconds:.2f} s on {world_size} rank(s), {steps} model calls per rank", file=sys.stderr)
        if args.output_json:
            from .zeroshot import write_json_report

            write_json_report(args.output_json, record)
    return record


def main(argv: Sequence[str] | None = None, *, hard_exit: bool = False) -> int:
    from .text import DataPrepError
    from .zeroshot import CheckpointMismatchError, leave_process_group

    args = build_parser().parse_args(argv)
    code = 0
    try:
        run(args)
    except (CheckpointMismatchError, DataPrepError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        code = 2
    leave_process_group(code, hard_exit=hard_exit)
    return code


def cli() -> None:
    """Console entry point of ``smlp-generate`` (no third-party import warnings: smlp/third_party.py)."""
    from smlp.third_party import quiet_imports

    quiet_imports(deepspeed=False)  # it trains nothing: fairseq's one DeepSpeed user is an optimizer
    sys.exit(main(hard_exit=True))


if __name__ == "__main__":
    cli()
