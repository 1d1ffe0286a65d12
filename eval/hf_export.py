"""smlp-export: a trained checkpoint -> a Hugging Face model folder that transformers loads.

    smlp-export CHECKPOINT --hf OUT_DIR [--data-dir DATA_BIN] [--dtype float32|bfloat16|float16]
                [--prefix-fill text|eos] [--force] [--no-verify]

CHECKPOINT is a consolidated checkpoint (smlp-consolidate) or the name X.pt of a set of rank shards
X-rank-R.pt, merged in memory (`fairseq_plugins.checkpoints.load_for_eval`). The model is built as
smlp-zeroshot and smlp-generate build it, with the data folder recorded in the checkpoint (or
--data-dir) for its dictionary and sentencepiece model. The folder it writes:

    config.json             SMLPConfig (model_type "smlp", auto_map): `lm_config` = every field of the
                            core's LMConfig, `routing_prefix` (P, the positions a partial-prediction sMLP
                            routes on and does not predict; 0 otherwise) and `routing_prefix_fill` (the P
                            tokens smlp-generate puts before short prompts), the special token ids
    model.safetensors       the core's state dict under `model.`: parameters and persistent buffers (the
                            HASH layers' token -> expert table), in --dtype; no pickle
    modeling_smlp.py        eval/hf_modeling.py with the installed core's sources embedded
                            (eval/hf_core_bundle.py): imports only torch, transformers and the
                            standard library (and numpy, which transformers requires)
    tokenization_smlp.py    eval/hf_tokenizer.py: the training pipeline's Encoder
    vocab.json, spm.model   the fairseq dictionary (piece -> id, specials included) and the
                            sentencepiece model (absent for whitespace-token data)
    tokenizer_config.json, special_tokens_map.json, generation_config.json, README.md

Loading it: AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True) and
AutoTokenizer.from_pretrained(OUT_DIR, trust_remote_code=True); docs/export.md has the rest.

Refused before anything is written, with the reason: a checkpoint of another architecture than
smlp_lm, gmlp_lm and moe_transformer_lm; sMoE routing leaky-full-sequence (its router reads future
positions: not a causal language model); a dictionary whose specials are not fairseq's <s> <pad>
</s> <unk> at ids 0-3 or that maps two ids to one piece; an existing OUT_DIR without --force, and with
--force one that is not a folder this program wrote (its config.json records `smlp_export`) or that holds
other files than the ones it writes (`EXPORTED_FILES`): only an earlier export is replaced. Missing parent
folders of OUT_DIR are created (and removed again if the export fails).

Atomic: the folder is written as a hidden sibling (.NAME.tmp-PID), checked (unless --no-verify: the
folder's own modeling and tokenizer files load it, and its logits on a sample equal the
checkpoint's core in the exported dtype, its tokenization the pipeline's), and only then renamed
to OUT_DIR. A failure leaves no OUT_DIR (or the previous one, with --force) and no temporary folder.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from smlp.files import install_dir, temp_dir, write_atomic, write_atomic_by_name

from .files import OutputPathError, check_output_path, make_parents, remove_folders

PROG = "smlp-export"
MODELING_FILE = "modeling_smlp.py"
TOKENIZER_FILE = "tokenization_smlp.py"
WEIGHTS_FILE = "model.safetensors"
DTYPES = ("float32", "bfloat16", "float16")
OUR_MODELS = ("smlp_lm", "gmlp_lm", "moe_transformer_lm")
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0-3 of fairseq's Dictionary
# every file a folder of this program holds: --force replaces a folder only if it holds nothing else
EXPORTED_FILES = ("config.json", WEIGHTS_FILE, MODELING_FILE, TOKENIZER_FILE, "vocab.json", "spm.model",
                  "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "README.md")
CORE_BEGIN, CORE_END = "# <smlp-export: core>", "# </smlp-export: core>"
# a sample the verification scores and tokenizes: line breaks, runs of spaces, non-ASCII
VERIFY_TEXT = "To be, or not  to be: that is the question.\n  Whether 'tis nobler in the mind — to suffer\n"

__all__ = ["ExportError", "export", "modeling_source", "main", "build_parser"]


class ExportError(ValueError):
    """A checkpoint the folder cannot represent, or a bad option; the message says why and what to do."""


# ------------------------------------------------------------------------------ the generated files


def _source_of(module: str) -> str:
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).read_text(encoding="utf-8")


@functools.cache
def modeling_source() -> str:
    """modeling_smlp.py: smlp_eval.hf_modeling with its core block replaced by the embedded core (made once
    per process: it depends only on the installed sources)."""
    from smlp.lm import LanguageModel, LMConfig

    from .hf_core_bundle import bundle_package, bundle_source, core_modules

    template = _source_of("smlp_eval.hf_modeling")
    head, sep, rest = template.partition(CORE_BEGIN)
    block, sep2, tail = rest.partition(CORE_END)
    if not sep or not sep2:
        raise RuntimeError(f"eval/hf_modeling.py lost its {CORE_BEGIN!r} ... {CORE_END!r} markers")
    names = {"LanguageModel": LanguageModel.__module__, "LMConfig": LMConfig.__module__}
    found = {m.name: m for root in sorted(set(names.values())) for m in core_modules(root)}
    modules = [found[n] for n in sorted(found)]
    binding = [f"{name} = _import_core({module.partition('.')[2]!r}).{name}" for name, module in names.items()]
    block = (f"{CORE_BEGIN}: the smlp core ({len(modules)} modules), registered as the package "
             f"{bundle_package(modules)}\n{bundle_source(modules)}\n" + "\n".join(binding) + "\n")
    header = (f"# Generated by {PROG} from eval/hf_modeling.py and the smlp core's own sources; do not edit.\n"
              f"# Core modules: {', '.join(m.path for m in modules)}\n")
    return header + head + block + sep2 + tail.split("\n", 1)[1]


def _readme(core, checkpoint: str, dtype: str, files: list[str]) -> str:
    P = core.prediction_start
    routing = (f"\n## Routing prefix\n\nThis is a partial-prediction sMLP (sMLP section 3.2.2): its sMoE layers "
               f"route on the first P = {P} positions of a sequence (`routing_prefix` in config.json) and predict "
               f"only from position {P} on. Logits at positions < {P} are not predictions; the loss ignores them. For "
               f"generation or scoring, put at least {P} tokens before the first position you need predicted: "
               f"`model.with_routing_prefix(input_ids)` left-fills a batch with the end of `routing_prefix_fill` "
               f"(text that ends a line), as smlp-generate does.\n") if P else ""
    return f"""# smlp {core.family} language model

Exported by `{PROG}` from `{checkpoint}` ({dtype} weights).

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)
```

The modeling code (`{MODELING_FILE}`) carries the smlp core's own layers; it needs torch and
transformers. The tokenizer (`{TOKENIZER_FILE}`) reproduces the training data pipeline: line breaks
are `</s>`, sentencepiece pieces map to the fairseq dictionary's ids, and every sequence starts with
`</s>` (`bos_token`). A sequence holds at most {core.seq_len} tokens (the spatial weights are tied to
absolute positions: pad on the right only, and generate prompts of one length per batch).
{routing}
Files: {', '.join(files)}.
"""


# ------------------------------------------------------------------------------ checks


def check_replaceable(out: Path, force: bool) -> None:
    """ExportError unless `out` may be written: absent, or (with --force) an empty folder or a folder an
    earlier export wrote and nothing else (config.json with `smlp_export`, only `EXPORTED_FILES`)."""
    try:
        check_output_path(out, "--hf", folder=True)
    except OutputPathError as exc:
        raise ExportError(str(exc)) from None
    if not out.exists():
        return
    if not force:
        raise ExportError(f"{out} exists: choose another --hf folder, or pass --force to replace an earlier export")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or "smlp_export" not in config:
        raise ExportError(f"--force replaces only a folder {PROG} wrote, and {out} is not one (no config.json "
                          f"recording smlp_export; it holds {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                          f"): nothing was changed; choose another --hf folder")
    foreign = [n for n in names if n not in EXPORTED_FILES]
    if foreign:
        raise ExportError(f"{out} is an earlier export but also holds files {PROG} does not write "
                          f"({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}), which --force would "
                          f"delete: nothing was changed; move them out, or choose another --hf folder")


def _saved_model_name(path: str) -> str | None:
    """The fairseq model name recorded in a checkpoint (cfg.model._name, or args.arch)."""
    from fairseq_plugins.checkpoints import read_checkpoint_any_layout

    state, _ = read_checkpoint_any_layout(path)
    cfg = state.get("cfg")
    model = cfg.get("model") if cfg is not None and hasattr(cfg, "get") else None
    if model is not None and model.get("_name"):
        return str(model.get("_name"))
    args = state.get("args")
    return getattr(args, "arch", None)


def _refuse_foreign(path: str, built=None) -> None:
    """ExportError unless `path` holds one of our models (fairseq records the architecture, e.g.
    smlp_lm_tiny, whose model is smlp_lm); `built`: a model fairseq built that is not ours."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    import fairseq_plugins  # noqa: F401  (registers our architectures)

    arch = _saved_model_name(path)
    model = ARCH_MODEL_NAME_REGISTRY.get(arch, arch)
    if model in OUR_MODELS and built is None:
        return
    what = f"{model} model" + (f" (architecture {arch})" if arch != model else "") if arch else "model of unknown kind"
    raise ExportError(f"{path} holds a {what}: {PROG} exports the models of this project ({', '.join(OUR_MODELS)}), "
                      f"whose layers the folder's modeling code carries")


def _load(path: str, data_dir: str | None):
    """(fairseq model, core, Encoder), refusing a checkpoint of another architecture."""
    from smlp.lm import LanguageModel

    from .zeroshot import load_model

    try:
        model, _, encoder = load_model(path, data_dir, "cpu")
    except FileNotFoundError:
        raise
    except Exception:  # fairseq could not build or fill the model: say so when it is not one of ours
        _refuse_foreign(path)
        raise
    core = getattr(model, "core", None)
    if not isinstance(core, LanguageModel):
        _refuse_foreign(path, built=model)
    return model, core.eval(), encoder


def check_representable(core) -> None:
    cfg = core.cfg
    if cfg.family == "smlp" and cfg.sparse_layers and cfg.sparse_block.smoe.leaky:
        raise ExportError(f"sMoE routing {cfg.smoe_routing!r} reads every position, future ones included (sMLP "
                          f"Appendix B): the model is not a causal language model, and a folder loaded as one would "
                          f"score and generate with text it should not see. Export a deterministic or partial model")


def dictionary_vocab(dictionary) -> dict[str, int]:
    """piece -> id of a fairseq Dictionary, refusing what the tokenizer files cannot hold."""
    specials = [dictionary[i] for i in (dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk())]
    ids = [dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()]
    if specials != list(FAIRSEQ_SPECIALS) or ids != [0, 1, 2, 3]:
        raise ExportError(f"the dictionary's specials are {list(zip(specials, ids))}, not fairseq's "
                          f"{list(zip(FAIRSEQ_SPECIALS, range(4)))}: the tokenizer files expect those")
    symbols = list(dictionary.symbols)
    vocab = dict(dictionary.indices)
    twice = [s for i, s in enumerate(symbols) if vocab.get(s) != i]
    if twice or len(vocab) != len(symbols):
        raise ExportError(f"the dictionary lists {len(symbols)} symbols but maps {len(vocab)} pieces (e.g. "
                          f"{twice[:3]} appear twice, a #fairseq:overwrite dict.txt): vocab.json cannot map ids back "
                          f"to pieces")
    return vocab


def _lm_config(core) -> dict:
    from smlp.lm import LMConfig

    fields = dataclasses.asdict(core.cfg)
    if LMConfig(**json.loads(json.dumps(fields))) != core.cfg:
        raise ExportError(f"the core config {core.cfg} does not survive JSON (config.json) unchanged")
    return fields


def _routing_prefix_fill(core, encoder, prefix_fill: str) -> list[int]:
    from fairseq_plugins.prefix_fill import routing_prefix_fill

    P = core.cfg.prediction_start
    if not P:
        return []
    if prefix_fill == "eos":
        return [encoder.eos] * P
    try:
        return [int(i) for i in routing_prefix_fill(encoder.dictionary, encoder.data_dir, P)[0]]
    except FileNotFoundError as exc:
        raise ExportError(f"{exc} (smlp-export --prefix-fill eos stores </s> repeated instead)") from None


# ------------------------------------------------------------------------------ writing


def _json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def fp32_state_names(core) -> set[str]:
    """State-dict names the model keeps in fp32 whatever its dtype (the balanced routers' evaluation prices,
    smlp/routing/prices.py): exported in fp32 by every --dtype."""
    from smlp.routing.prices import RouterPrices

    return {f"{name}.{b}" for name, m in core.named_modules() if isinstance(m, RouterPrices)
            for b, _ in m.named_buffers(recurse=False)}


def _write_folder(folder: Path, core, encoder, *, checkpoint: str, dtype: str, prefix_fill: str) -> list[str]:
    import torch
    from safetensors.torch import save_file

    from fairseq_plugins.config import fairseq_flags

    vocab = dictionary_vocab(encoder.dictionary)
    lm_config = _lm_config(core)
    fill = _routing_prefix_fill(core, encoder, prefix_fill)
    eos, pad = encoder.eos, encoder.pad
    torch_dtype = getattr(torch, dtype)
    keep = fp32_state_names(core)  # the balanced routers' prices: fp32 in the checkpoint, fp32 here
    weights = {f"model.{k}": (v.to(torch_dtype) if v.is_floating_point() and k not in keep else v).detach()
               .contiguous().clone() for k, v in core.state_dict().items()}
    write_atomic_by_name(folder / WEIGHTS_FILE, lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))
    auto_map = {"AutoConfig": "modeling_smlp.SMLPConfig", "AutoModelForCausalLM": "modeling_smlp.SMLPForCausalLM"}
    versions = {"transformers_version": _version("transformers")} if _version("transformers") else {}
    _json(folder / "config.json", {
        "architectures": ["SMLPForCausalLM"], "auto_map": auto_map, "model_type": "smlp",
        "lm_config": lm_config, "routing_prefix": core.cfg.prediction_start, "routing_prefix_fill": fill,
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": pad, "dtype": dtype, **versions,
        "smlp_export": {"checkpoint": checkpoint, "fairseq_flags": fairseq_flags(core.cfg),
                        "smlp_version": _version("smlp")}})
    _json(folder / "generation_config.json", {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": pad,
                                              **versions})
    write_atomic(folder / MODELING_FILE, modeling_source())
    write_atomic(folder / TOKENIZER_FILE, _source_of("smlp_eval.hf_tokenizer"))
    _json(folder / "vocab.json", vocab)
    if encoder.sp is not None:
        shutil.copyfile(encoder.spm_model, folder / "spm.model")
    specials = {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    _json(folder / "special_tokens_map.json", specials)
    _json(folder / "tokenizer_config.json", {
        "tokenizer_class": "SMLPTokenizer", "auto_map": {"AutoTokenizer": [f"{TOKENIZER_FILE[:-3]}.SMLPTokenizer",
                                                                           None]},
        **specials, "model_max_length": core.cfg.seq_len, "padding_side": "right",
        "split_special_tokens": True, "clean_up_tokenization_spaces": False})
    files = sorted(p.name for p in folder.iterdir()) + ["README.md"]
    write_atomic(folder / "README.md", _readme(core.cfg, checkpoint, dtype, sorted(files)))
    return sorted(files)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and transformers look classes' modules up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def verify_folder(folder: Path, core, encoder, dtype: str) -> float:
    """Load `folder` with its own files and compare with the core and the Encoder; returns the largest
    logit difference. ExportError when the logits differ by more than 1e-5 (scaled to the logits'
    size in half precision) or the tokenization differs."""
    import copy

    import torch
    from transformers.utils import logging as hf_logging

    tag = f"_smlp_export_verify_{os.getpid()}_{id(folder)}"
    modeling = _import_file(folder / MODELING_FILE, tag + "_modeling")
    tokenization = _import_file(folder / TOKENIZER_FILE, tag + "_tokenization")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the export's output
    try:
        hf, info = modeling.SMLPForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype),
                                                            output_loading_info=True)
        hf.eval()
        unread = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if unread:
            raise ExportError(f"loading the folder back left weights unread or uninitialized: {unread}")
        tok = tokenization.SMLPTokenizer.from_pretrained(str(folder))
        theirs = tok(VERIFY_TEXT)["input_ids"]
        ours = [encoder.eos, *encoder.encode_ids(VERIFY_TEXT)]
        if theirs != ours:
            raise ExportError(f"the folder's tokenizer gives {theirs[:12]}... for a sample, the pipeline "
                              f"{ours[:12]}...")
        reference = copy.deepcopy(core).to(getattr(torch, dtype)) if dtype != "float32" else core
        g = torch.Generator().manual_seed(0)
        n = min(core.cfg.seq_len, 48)
        tokens = torch.randint(4, core.cfg.vocab_size, (2, n), generator=g)
        m = min(n, len(ours))
        tokens[0, :m] = torch.tensor(ours[:m])
        tokens[1, 0] = encoder.eos
        with torch.no_grad():
            want, got = reference(tokens).float(), hf(tokens).logits.float()
        diff = float((want - got).abs().max())
        bound = 1e-5 if dtype == "float32" else 1e-5 * max(1.0, float(want.abs().max()))
        if not diff <= bound:
            raise ExportError(f"the exported model's logits differ from the checkpoint's by {diff:.3g} (allowed "
                              f"{bound:.1g}): the folder was not installed")
        return diff
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        sys.modules.pop(tag + "_modeling", None)
        sys.modules.pop(tag + "_tokenization", None)


@dataclasses.dataclass
class ExportResult:
    folder: Path
    files: list[str]
    family: str
    routing_prefix: int
    max_logit_difference: float | None


def export(checkpoint: str, out: str | Path, *, data_dir: str | None = None, dtype: str = "float32",
           prefix_fill: str = "text", force: bool = False, verify: bool = True) -> ExportResult:
    """Write the Hugging Face folder of `checkpoint` to `out` (module docstring); returns what was written."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if prefix_fill not in ("text", "eos"):
        raise ExportError(f"--prefix-fill {prefix_fill} is not one of text, eos")
    out = Path(out).expanduser().absolute()
    if out.is_symlink():  # --hf through a link: the folder is written where it points, the link stays
        out = Path(os.path.realpath(out))
    check_replaceable(out, force)
    for module in ("safetensors", "transformers") if verify else ("safetensors",):
        if importlib.util.find_spec(module) is None:
            raise ExportError(f"{module} is not installed: install the hf extra (pip install -e '.[hf]')")
    _, core, encoder = _load(checkpoint, data_dir)
    check_representable(core)
    dictionary_vocab(encoder.dictionary)  # refused here, before a folder exists
    created = make_parents(out)
    tmp = None
    try:
        tmp = temp_dir(out)
        files = _write_folder(tmp, core, encoder, checkpoint=checkpoint, dtype=dtype, prefix_fill=prefix_fill)
        diff = verify_folder(tmp, core, encoder, dtype) if verify else None
        check_replaceable(out, force)  # again: the folder may have changed during the work
        install_dir(tmp, out, replace=force)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
        remove_folders(created)
        raise
    return ExportResult(out, files, core.cfg.family, core.cfg.prediction_start, diff)


# ------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint (consolidated, or the name X.pt of rank shards X-rank-R.pt)")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="the Hugging Face model folder to write")
    p.add_argument("--data-dir", default=None, help="binarized data folder (dict.txt, spm.model); default: the "
                                                   "one recorded in the checkpoint")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the saved weights (float32)")
    p.add_argument("--prefix-fill", choices=("text", "eos"), default="text",
                   help="partial prediction: the routing_prefix_fill stored in config.json: the end of the data "
                        "folder's valid split (text, as smlp-generate) or </s> repeated (eos)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR if it is an earlier export of this program (and holds nothing else)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip loading the written folder back and comparing its logits and tokenization")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from .text import DataPrepError
    from .zeroshot import CheckpointMismatchError

    args = build_parser().parse_args(argv)
    try:
        result = export(args.checkpoint, args.hf, data_dir=args.data_dir, dtype=args.dtype,
                        prefix_fill=args.prefix_fill, force=args.force, verify=not args.no_verify)
    except (ExportError, CheckpointMismatchError, DataPrepError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    checked = ("" if result.max_logit_difference is None else
               f"; loaded back: its logits differ from the checkpoint's by at most {result.max_logit_difference:.2g}, "
               f"its tokenizer equals the pipeline's")
    prefix = f", routing prefix {result.routing_prefix}" if result.routing_prefix else ""
    print(f"wrote {result.folder} ({result.family}{prefix}; {', '.join(result.files)}){checked}")
    print(f"load it with: AutoModelForCausalLM.from_pretrained({str(result.folder)!r}, trust_remote_code=True)")
    return 0


def cli() -> None:
    """Console entry point of ``smlp-export`` (no third-party import warnings: smlp/third_party.py)."""
    from smlp.third_party import quiet_imports

    quiet_imports(deepspeed=False)
    sys.exit(main())


if __name__ == "__main__":
    cli()
