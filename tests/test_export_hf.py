"""smlp-export: Hugging Face model folders (eval/hf_export.py, hf_modeling.py, hf_tokenizer.py, hf_core_bundle.py).

Train once, check many ways: one data folder made by the demo's own pipeline (`prepare_data(demo=True)`
on two plays), one 3-update checkpoint per model family trained in this process, its weights then
perturbed in the checkpoint file (so that spatial weights, routers and experts matter; the HASH
layers' table is permuted, so only a table that travels in the folder gives the same logits), and
each exported once. References: the checkpoint loaded as smlp-zeroshot loads it (logits),
smlp-generate (tokens), the binarized data (tokenization), the project's lm-eval adapter (COPA, PIQA).
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

from tolerance import assert_orders_agree

pytest.importorskip("transformers")  # the hf extra; `make test` installs it

from smlp_eval import hf_export  # noqa: E402
from smlp_eval.hf_core_bundle import BundleError, bundle_source, core_modules  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the folders load without the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
PLUGINS = str(REPO / "fairseq_plugins")
T = 64
EXPERTS = ["--num-experts", "2"]
FAMILIES = {  # id -> (architecture, flags)
    "smlp-det": ("smlp_lm_tiny", EXPERTS),
    "smlp-partial": ("smlp_lm_tiny", [*EXPERTS, "--smoe-routing", "partial"]),
    "gmlp": ("gmlp_lm_tiny", []),
    "transformer": ("transformer_lm_tiny", []),
    "gshard": ("gshard_lm_tiny", EXPERTS),
    "switch": ("switch_lm_tiny", EXPERTS),
    "base": ("base_layers_lm_tiny", EXPERTS),
    "hash": ("hash_layers_lm_tiny", EXPERTS),
    "hypermixer": ("hypermixer_lm_tiny", []),
    "ninformer": ("ninformer_lm_tiny", []),
    "gmlp-token-routed": ("gmlp_lm_tiny", ["--token-routed-experts", "2"]),
}
PROMPT = "Thou art"  # shorter than sMLP-partial's routing prefix: with_routing_prefix fills it
VERIFIED = ("smlp-partial", "hash", "gmlp-token-routed")  # exported with the load-back check


# ============================================================================ fixtures


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """smlp-prepare-data --demo on two plays (vocabulary 500): the demo's tokenizer and binarized text."""
    from smlp_launch import data as D

    plays = {p.name: p for p in D.demo_inputs()}
    out, _ = D.prepare_data(tmp_path_factory.mktemp("export_data") / "demo", [plays["macbeth_gut.txt"],
                            plays["tempest_gut.txt"]], demo=True, vocab_size=500, workers=1, log=None)
    return out


def _train(data: Path, save: Path, arch: str, extra: list[str], updates: int = 3, seq_len: int = T) -> Path:
    from fairseq_helpers import run_in_process

    args = [str(data), "--user-dir", PLUGINS, "--task", "language_modeling", "--arch", arch, "--criterion",
            "smlp_lm_loss", "--tokens-per-sample", str(seq_len), "--batch-size", "8", "--optimizer", "adam",
            "--lr", "3e-3", "--max-update", str(updates), "--save-dir", str(save), "--seed", "1", "--log-format",
            "simple", "--no-epoch-checkpoints", "--disable-validation", "--num-workers", "0", *extra]
    with contextlib.redirect_stdout(io.StringIO()):  # fairseq prints the model
        run_in_process("fairseq-train", args)
    return save / "checkpoint_last.pt"


def _perturb(path: Path, seed: int = 0) -> None:
    """Rewrite the checkpoint with weights moved off their (nearly trivial) initial values and every
    HASH table permuted (a table the model's seed does not give)."""
    from fairseq_plugins.checkpoints import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()
    state = torch.load(path, map_location="cpu", weights_only=True)
    g = torch.Generator().manual_seed(seed)
    for name, t in state["model"].items():
        if name.endswith("hash_table"):
            state["model"][name] = t[torch.randperm(t.numel(), generator=g)]
        elif t.is_floating_point() and not name.endswith("embed.weight"):
            t.add_(torch.randn(t.shape, generator=g) * 2 / max(1, t.shape[-1] if t.dim() else 1) ** 0.5)
    torch.save(state, path)


@pytest.fixture(scope="module")
def checkpoints(demo_data, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family, (arch, extra) in FAMILIES.items():
        out[family] = _train(demo_data, tmp_path_factory.mktemp(f"ck_{family}"), arch, extra)
        _perturb(out[family])
    return out


@pytest.fixture(scope="module")
def folders(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Each family exported once (the export loads the folder back and compares it before installing it)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family, ckpt in checkpoints.items():
        verify = family in VERIFIED  # the others are compared by the tests below
        result = hf_export.export(str(ckpt), root / f"hf-{family}", verify=verify)
        assert (result.max_logit_difference is not None) == verify
        assert not verify or result.max_logit_difference <= 1e-5
        out[family] = result.folder
    return out


@pytest.fixture(scope="module")
def long_model(demo_data, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, folder) of an sMLP with T = 192: lm-eval's hf model refuses a continuation longer than
    the model's positions (the project's adapter scores it in windows), and PIQA's reach 167 tokens here."""
    ckpt = _train(demo_data, tmp_path_factory.mktemp("ck_long"), "smlp_lm_tiny", [*EXPERTS, "--batch-size", "2"],
                  seq_len=192)
    _perturb(ckpt)
    return ckpt, hf_export.export(str(ckpt), tmp_path_factory.mktemp("hf_long") / "hf-long", verify=False).folder


@pytest.fixture(scope="module")
def loaded(folders):
    """family -> (model, tokenizer) loaded from the folder with trust_remote_code, once per family."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = _hf(folders[family]), _tokenizer(folders[family])
        return cache[family]
    return get


def _fairseq_model(ckpt: Path):
    from fairseq_plugins.checkpoints import load_for_eval

    return load_for_eval(str(ckpt))[0]


def _hf(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, **kwargs).eval()


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)


def _held_out(demo_data: Path, tok, rows: int = 2) -> torch.Tensor:
    """(rows, T) windows of the test split (never trained on), each starting with </s>."""
    ids = tok((demo_data / "text" / "test.txt").read_text(encoding="utf-8"))["input_ids"]
    return torch.tensor([[tok.eos_token_id, *ids[1 + r * T:(r + 1) * T]] for r in range(rows)])


def _encoder(demo_data: Path):
    from smlp_eval.text import load_encoder

    return load_encoder(demo_data)


# ============================================================================ logits and generation


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_logits_equal_the_checkpoints_on_held_out_text(family, loaded, checkpoints, demo_data):
    """fp32, within 1e-5, every family; the folder runs its own embedded copy of the core."""
    hf, tok = loaded(family)
    assert type(hf).__module__.startswith("transformers_modules.")  # the folder's modeling_smlp.py
    assert type(hf.model).__module__.startswith("_smlp_core_")  # the core embedded in it, not smlp/
    tokens = _held_out(demo_data, tok)
    with torch.no_grad():
        want = _fairseq_model(checkpoints[family])(tokens)[0]
        got = hf(tokens).logits
    assert got.dtype == want.dtype == torch.float32 and got.shape == (2, T, hf.config.vocab_size)
    assert float((got - want).abs().max()) <= 1e-5
    assert float(want.std()) > 0.1  # the comparison is not between two near-constant outputs
    P = hf.config.routing_prefix
    assert P == (round(0.2 * T) if family == "smlp-partial" else 0)
    assert len(hf.config.routing_prefix_fill) == P


def _smlp_generate(ckpt: Path, tmp: Path, max_new: int) -> list[int]:
    from smlp_eval.generate import main

    prompts, out = tmp / "prompts.txt", tmp / "generated.json"
    prompts.write_text(PROMPT + "\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["--path", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", str(max_new),
                     "--output-json", str(out), "--device", "cpu"]) == 0
    return json.loads(out.read_text())["results"][0]["tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_and_without_cache_equals_smlp_generate(family, loaded, checkpoints, tmp_path):
    """Greedy `generate()` through the folder, with the core's cache and recomputing, gives the tokens
    smlp-generate gives (up to </s>); sMLP-partial's prompt is left-filled by with_routing_prefix."""
    max_new = 6
    expected = _smlp_generate(checkpoints[family], tmp_path, max_new)
    hf, tok = loaded(family)
    prompt = tok(PROMPT, return_tensors="pt")["input_ids"]
    ids = hf.with_routing_prefix(prompt)  # partial: the fill, then the prompt, whose last token sits at position P
    assert ids.shape[1] == max(prompt.shape[1], hf.config.routing_prefix + 1) and torch.equal(ids[:, -6:], prompt)
    for use_cache in (True, False):
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          use_cache=use_cache)
        new = out[0, ids.shape[1]:].tolist()
        new = new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        assert new == expected, (family, use_cache)


@pytest.mark.parametrize("family", ["smlp-det", "transformer", "gmlp-token-routed"])
def test_beam_search_reorders_the_cache(family, loaded):
    """Beam search reorders past_key_values (reorder_cache): every returned beam equals the recomputing run."""
    hf, tok = loaded(family)
    rows = tok(["To be, or not to be", "Full fathom five thy father lies"])["input_ids"]
    ids = torch.tensor([row[:6] for row in rows])  # one length: rows start at position 0
    runs = [hf.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                        use_cache=use_cache, eos_token_id=None) for use_cache in (True, False)]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (6, ids.shape[1] + 6)


def test_the_folder_loads_offline_without_this_project(folders, checkpoints, demo_data, tmp_path):
    """In a fresh process with smlp, smlp_eval, fairseq and fairseq_plugins unimportable, a fresh
    transformers module cache and HF_HUB_OFFLINE=1: the folder loads with trust_remote_code and gives
    the checkpoint's logits."""
    folder = folders["smlp-partial"]
    script = textwrap.dedent(f"""
        import json, sys
        for name in ("smlp", "smlp_eval", "smlp_launch", "fairseq", "fairseq_plugins"):
            sys.modules[name] = None  # importing them raises ImportError
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)
        ids = tok(open({str(demo_data / 'text' / 'test.txt')!r}).read())["input_ids"][:{T}]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        print(json.dumps({{"ids": ids, "logits": logits.tolist()}}))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        want = _fairseq_model(checkpoints["smlp-partial"])(torch.tensor([got["ids"]]))[0][0]
    assert float((torch.tensor(got["logits"]) - want).abs().max()) <= 1e-5
    assert (tmp_path / "hf_home" / "modules" / "transformers_modules").is_dir()  # remote code, freshly copied


def test_transformers_finds_no_sibling_files_and_only_allowed_imports(folders):
    """transformers' own scans of the generated file: no `from .x import` it would look for next to it, and
    imports of torch, numpy, transformers and the standard library only."""
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    modeling = folders["smlp-det"] / hf_export.MODELING_FILE
    assert get_relative_imports(str(modeling)) == []
    assert set(get_imports(str(modeling))) - set(sys.stdlib_module_names) == {"torch", "transformers"}
    assert set(get_imports(str(folders["smlp-det"] / hf_export.TOKENIZER_FILE))) - set(sys.stdlib_module_names) \
        == {"transformers"}  # sentencepiece is imported where a folder has spm.model


# ============================================================================ tokenizer


def test_tokenizer_reproduces_the_binarized_demo_corpus(folders, demo_data):
    """Every split of the demo pipeline's text, tokenized by the folder's tokenizer, is the token stream
    fairseq-preprocess wrote (each line's pieces, then </s>), read back with fairseq's own reader."""
    from smlp_eval.text import load_binarized

    tok, enc = _tokenizer(folders["smlp-det"]), _encoder(demo_data)
    for split in ("train", "valid", "test"):
        text = (demo_data / "text" / f"{split}.txt").read_text(encoding="utf-8")
        ds = load_binarized(demo_data / split, enc.dictionary)
        stream = torch.cat([ds[i] for i in range(len(ds))]).tolist()
        ours = tok(text, add_special_tokens=False)["input_ids"]
        assert ours == stream, split
    lines = text.split("\n")[:50]  # the batch path, and the </s> that starts every sequence
    assert tok(lines)["input_ids"] == [[enc.eos, *enc.encode_ids(line)] for line in lines]
    assert tok.decode(stream[:400]) == enc.decode_ids(stream[:400])


def test_tokenizer_normalizes_and_maps_specials_as_the_pipeline(folders, demo_data):
    tok, enc = _tokenizer(folders["smlp-det"]), _encoder(demo_data)
    raw = "  Whether 'tis\tnobler\u00a0 in the mind \r\n\n to suffer </s> <s> <pad> <unk> — ünïcödé 字"
    ids = tok(raw)["input_ids"]
    assert ids == [enc.eos, *enc.encode_ids(raw)]
    assert ids.count(enc.eos) == 3  # the sequence start and two line breaks; the literal "</s>" is text
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (2, 1, 2, 3)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<s>", "<pad>", "</s>", "<unk>"]
    assert len(tok) == len(enc.dictionary)
    odd = [0, 2, *ids[1:6], 3, 1, 1]
    assert tok.decode(odd) == enc.decode_ids(odd)  # <s>, <pad> dropped; </s> a line break; <unk> as sentencepiece
    assert tok.decode(ids, skip_special_tokens=True) == enc.decode_ids([i for i in ids if i > 3])
    padded = tok(["To be", "or not to be"], padding=True, return_tensors="pt")
    assert padded["input_ids"][0, -1] == tok.pad_token_id and padded["attention_mask"][0, -1] == 0  # right padding


def test_saved_tokenizer_loads_again(folders, tmp_path):
    tok = _tokenizer(folders["smlp-det"])
    tok.save_pretrained(tmp_path / "again")
    assert {p.name for p in (tmp_path / "again").iterdir()} >= {"spm.model", "vocab.json", "tokenizer_config.json"}
    again = type(tok).from_pretrained(str(tmp_path / "again"))
    text = "Double, double toil and trouble;\nFire burn and cauldron bubble."
    assert again(text)["input_ids"] == tok(text)["input_ids"]


# ============================================================================ lm-evaluation-harness


def test_lm_eval_hf_model_scores_the_folder_as_our_adapter_scores_the_checkpoint(long_model, demo_data, tmp_path):
    """lm-eval's own `hf` model type on the folder and the project's adapter on the checkpoint: the same
    per-example log-likelihoods and accuracies on COPA and PIQA (the same examples: --limit)."""
    import lm_eval

    from smlp_eval.lm_eval_adapter import SMLPLM
    from smlp_eval.tasks import default_data_path
    from test_zeroshot import LM_EVAL_CONFIGS, _arrow_file, _lm_eval_tasks

    n, tasks = 12, ("copa", "piqa")
    tm = _lm_eval_tasks(tmp_path, {t: (LM_EVAL_CONFIGS[t], "arrow", {"validation": _arrow_file(default_data_path(t))})
                                   for t in tasks})
    ckpt, folder = long_model
    ours_lm = SMLPLM(model=_fairseq_model(ckpt), encoder=_encoder(demo_data), progress=False)
    args = f"pretrained={folder},trust_remote_code=True,dtype=float32,device=cpu,batch_size=8"
    for t in tasks:
        runs = [lm_eval.simple_evaluate(model=m, model_args=a, tasks=[f"local_{t}"], task_manager=tm, limit=n,
                                        log_samples=True, bootstrap_iters=0)
                for m, a in ((ours_lm, None), ("hf", args))]
        ours, theirs = ([sorted(r["samples"][f"local_{t}"], key=lambda s: s["doc_id"]) for r in runs])
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] == list(range(n))
        for a, b in zip(ours, theirs):
            assert [r[0] for r in a["filtered_resps"]] == pytest.approx([r[0] for r in b["filtered_resps"]], abs=1e-4)
            assert [r[1] for r in a["filtered_resps"]] == [r[1] for r in b["filtered_resps"]]
            assert a["acc"] == b["acc"]
        acc = [r["results"][f"local_{t}"]["acc,none"] for r in runs]
        assert acc[0] == acc[1]
        print(f"lm-eval hf on the folder vs our adapter, {t}: {n} examples, acc {acc[1]:.4f}", file=sys.__stderr__)


# ============================================================================ the model class


def test_padding_labels_and_half_precision(folders, loaded, checkpoints, demo_data):
    hf, tok = loaded("smlp-partial")
    tokens = _held_out(demo_data, tok)
    P = hf.config.routing_prefix
    with torch.no_grad():
        logits = hf(tokens).logits
        # right padding: the real positions are those of the unpadded row
        short = tokens[:1, :40]
        padded = torch.cat([short, torch.full((1, T - 40), tok.pad_token_id)], dim=1)
        mask = (torch.arange(T) < 40).long()[None]
        # equal up to the rounding of products of other shapes (64 against 40 positions block differently on
        # some CPUs): tests/tolerance.py's bound over the sequence and the blocks
        assert_orders_agree(hf(padded, attention_mask=mask).logits[:, :40], hf(short).logits, reduction=T,
                            depth=len(hf.model.layers))
        with pytest.raises(ValueError, match="right"):
            hf(padded.flip(1), attention_mask=mask.flip(1))  # left padding
        with pytest.raises(ValueError, match="right"):
            hf(padded, attention_mask=mask, use_cache=True)
        # labels: the mean cross-entropy of the predictions made at positions >= P, -100 ignored
        labels = tokens.clone()
        labels[0, P + 5] = -100
        loss = hf(tokens, labels=labels).loss
        lp = torch.log_softmax(logits.float(), -1)
        picked = [-lp[b, i - 1, labels[b, i]] for b in range(2) for i in range(P + 1, T) if labels[b, i] != -100]
        assert float(loss) == pytest.approx(float(torch.stack(picked).mean()), rel=1e-5)
    core = _fairseq_model(checkpoints["smlp-partial"]).core
    for dtype in (torch.bfloat16, torch.float16):  # the folder loaded in half equals the core cast to it
        half = _hf(folders["smlp-partial"], dtype=dtype)
        assert next(half.parameters()).dtype == dtype
        with torch.no_grad():
            got, want = half(tokens).logits, copy.deepcopy(core).to(dtype)(tokens)
        assert got.dtype == dtype and torch.equal(got, want)
        out = half.generate(tokens[:1, :P + 2], max_new_tokens=4, do_sample=False)
        assert out.shape == (1, P + 6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_export(dtype, checkpoints, tmp_path):
    """--dtype writes half weights; the folder, loaded as saved, gives the core's logits in that dtype."""
    result = hf_export.export(str(checkpoints["hash"]), tmp_path / "half", dtype=dtype)
    assert result.max_logit_difference is not None
    from safetensors import safe_open

    with safe_open(str(result.folder / hf_export.WEIGHTS_FILE), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {getattr(torch, dtype), torch.int64}  # the HASH table stays integer
    hf = _hf(result.folder, dtype="auto")
    assert next(hf.parameters()).dtype == getattr(torch, dtype)


# ============================================================================ refusals, atomicity, CLI


def test_cli_prints_the_loading_lines_and_refuses_an_existing_folder(checkpoints, tmp_path, capsys):
    out = tmp_path / "hf" / "cli"  # README's `--hf hf/plays` on a fresh checkout: the parent is created
    assert hf_export.main([str(checkpoints["gmlp"]), "--hf", str(out), "--no-verify"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "AutoModelForCausalLM.from_pretrained" in printed
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_smlp.py", "tokenization_smlp.py", "vocab.json", "spm.model",
            "tokenizer_config.json", "generation_config.json", "README.md"} <= files
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))  # no pickle
    config = json.loads((out / "config.json").read_text())
    assert config["lm_config"]["family"] == "gmlp" and config["auto_map"]["AutoModelForCausalLM"]
    assert hf_export.main([str(checkpoints["gmlp"]), "--hf", str(out), "--no-verify"]) == 2
    assert "exists" in capsys.readouterr().err
    (out / "notes.txt").write_text("the user's own file")  # --force would delete it: refused
    assert hf_export.main([str(checkpoints["gmlp"]), "--hf", str(out), "--no-verify", "--force"]) == 2
    assert "also holds files smlp-export does not write (notes.txt)" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    before = (out / "model.safetensors").stat().st_ino
    assert hf_export.main([str(checkpoints["gmlp"]), "--hf", str(out), "--no-verify", "--force"]) == 0
    assert (out / "config.json").exists() and (out / "model.safetensors").stat().st_ino != before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_a_failed_export_leaves_no_folder_and_keeps_the_previous_one(checkpoints, tmp_path, monkeypatch):
    def planted(*args, **kwargs):
        raise hf_export.ExportError("planted verification failure")

    monkeypatch.setattr(hf_export, "verify_folder", planted)
    out = tmp_path / "atomic"
    with pytest.raises(hf_export.ExportError, match="planted"):
        hf_export.export(str(checkpoints["switch"]), out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "config.json").write_text('{"smlp_export": {}, "previous": true}')  # an earlier export's
    with pytest.raises(hf_export.ExportError, match="planted"):
        hf_export.export(str(checkpoints["switch"]), out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["atomic"] and "previous" in (out / "config.json").read_text()
    with pytest.raises(hf_export.ExportError, match="planted"):  # missing parents are created, then removed
        hf_export.export(str(checkpoints["switch"]), tmp_path / "new" / "deeper" / "hf")
    assert [p.name for p in tmp_path.iterdir()] == ["atomic"]


def test_another_architecture_is_refused_before_anything_is_written(checkpoints, tmp_path, capsys):
    from fairseq_plugins.checkpoints import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()
    state = torch.load(checkpoints["transformer"], map_location="cpu", weights_only=True)
    state["cfg"]["model"]["_name"] = "transformer_lm"  # fairseq's own Transformer LM
    foreign = tmp_path / "foreign.pt"
    torch.save(state, foreign)
    out = tmp_path / "out"
    assert hf_export.main([str(foreign), "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert "transformer_lm model" in err and "smlp_lm, gmlp_lm, moe_transformer_lm" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign.pt"]


def test_unrepresentable_models_and_dictionaries_are_refused():
    from fairseq.data import Dictionary

    from smlp.lm import LanguageModel, LMConfig

    leaky = LanguageModel(LMConfig(family="smlp", vocab_size=20, d_model=8, d_ffn=16, seq_len=10, dense_layers=1,
                                   sparse_layers=1, num_experts=2, smoe_routing="leaky-full-sequence"))
    with pytest.raises(hf_export.ExportError, match="not a causal language model"):
        hf_export.check_representable(leaky)
    d = Dictionary()
    d.add_symbol("hello")
    assert hf_export.dictionary_vocab(d) == {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "hello": 4}
    d.add_symbol("hello", overwrite=True)
    with pytest.raises(hf_export.ExportError, match="appear twice"):
        hf_export.dictionary_vocab(d)
    with pytest.raises(hf_export.ExportError, match="specials"):
        hf_export.dictionary_vocab(Dictionary(bos="<bos>"))


# ============================================================================ the core bundle


def _write_package(root: Path, name: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_bundle_follows_relative_absolute_nested_and_lazy_imports(tmp_path, monkeypatch):
    """A package laid out unlike smlp/ (nested subpackages, `from ..x import`, `from . import sub`, an import
    inside a function, one under TYPE_CHECKING, absolute `import pkg.x [as y]`, the same private name in two
    modules): the bundle holds exactly the modules the root needs and behaves like the package, under its own
    private name, never reading the package's files again (a second version loads beside the first)."""
    name = "corepkg_for_bundle_test"
    files = {
        "__init__.py": '"""the package"""\n',
        "api.py": """
            from typing import TYPE_CHECKING

            import corepkg_for_bundle_test.sub.inner
            import corepkg_for_bundle_test.sub.inner as inner_alias

            from . import sub
            from .sub.deep.leaf import scale

            if TYPE_CHECKING:
                from .typing_only import Hint

            def _helper():
                return "api"

            def run(x):
                from corepkg_for_bundle_test.lazy import late  # absolute, inside a function
                total = scale(x) + corepkg_for_bundle_test.sub.inner.offset() + late()
                assert inner_alias is sub.inner and corepkg_for_bundle_test.sub is sub
                return total, _helper(), sub.inner._helper()
            """,
        "sub/__init__.py": "from . import inner\n",
        "sub/inner.py": """
            def _helper():
                return "inner"

            def offset():
                return 10
            """,
        "sub/deep/__init__.py": "",
        "sub/deep/leaf.py": """
            import math

            from ...sub.inner import offset

            def scale(x):
                if x < 0:
                    raise ValueError("negative input reached leaf")  # a traceback shows this line
                return int(math.sqrt(x)) * offset()
            """,
        "lazy.py": "def late():\n    return 100\n",
        "typing_only.py": "Hint = int\n",
        "unused.py": "raise RuntimeError('never imported')\n",
    }
    _write_package(tmp_path, name, files)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = core_modules(f"{name}.api")
    assert [m.relative for m in modules] == ["", "api", "lazy", "sub", "sub.deep", "sub.deep.leaf", "sub.inner",
                                             "typing_only"]
    assert {m.path for m in modules} >= {f"{name}/sub/deep/leaf.py", f"{name}/sub/__init__.py"}
    ns: dict = {}
    exec(compile(bundle_source(modules) + "\napi = _import_core('api')\n", "<bundle>", "exec"), ns)
    api = ns["api"]
    assert api.__name__.startswith(f"_{name}_core_") and api.run(16) == (40 + 10 + 100, "api", "inner")
    try:
        api.run(-1)
    except ValueError:
        text = traceback.format_exc()
    assert f"{name}/sub/deep/leaf.py" in text and 'raise ValueError("negative input reached leaf")' in text
    # another version of the package loads beside the first, each under its own name
    (tmp_path / name / "lazy.py").write_text("def late():\n    return 200\n")
    ns2: dict = {}
    exec(compile(bundle_source(core_modules(f"{name}.api")) + "\napi = _import_core('api')\n", "<b2>", "exec"), ns2)
    assert ns2["api"].run(16)[0] == 250 and api.run(16)[0] == 150 and ns2["api"].__name__ != api.__name__


def test_the_bundle_refuses_imports_outside_torch_numpy_and_the_standard_library(tmp_path, monkeypatch):
    name = "corepkg_for_bundle_refusal"
    _write_package(tmp_path, name, {"__init__.py": "", "a.py": "from .b import f\n",
                                    "b.py": "import json\n\ndef f():\n    import fairseq\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BundleError, match=rf"{name}/b.py:4 imports fairseq"):
        core_modules(f"{name}.a")


def test_the_modeling_file_is_generated_from_the_installed_core():
    """Every module of smlp/ that LanguageModel needs is embedded verbatim; the template's repository
    binding is gone."""
    from smlp.lm import LanguageModel

    source = hf_export.modeling_source()
    modules = core_modules(LanguageModel.__module__)
    assert "from smlp.lm import" not in source and hf_export.CORE_END in source
    for m in modules:
        lines = "\n".join(f"        {line!r}," for line in m.source.split("\n")[:-1])
        assert f"    {m.relative!r}: ({m.is_package!r}, {m.path!r}, (\n{lines}\n    )),\n" in source, m.path
    assert {m.path for m in modules} >= {"smlp/lm.py", "smlp/__init__.py"}
    compile(source, "modeling_smlp.py", "exec")


# ============================================================================ rank shards


@pytest.mark.slow
def test_a_rank_shard_set_exports_merged(smlp_tiny_two_ranks, tiny_lm_data, tmp_path):
    """The shards of a 2-rank expert-parallel run (one expert each) export as one model holding both experts,
    with the whitespace-token tokenizer of its data folder (no spm.model) reproducing fairseq-preprocess."""
    from smlp_eval.text import Encoder, load_binarized

    save, _ = smlp_tiny_two_ranks("deterministic")
    ckpt = save / "checkpoint_last.pt"
    assert not ckpt.exists() and (save / "checkpoint_last-rank-1.pt").exists()
    result = hf_export.export(str(ckpt), tmp_path / "shards")
    assert "spm.model" not in result.files
    hf, tok = _hf(result.folder), _tokenizer(result.folder)
    assert hf.model.cfg.num_experts == 2
    text = (tiny_lm_data.parent / "valid.txt").read_text()
    enc = Encoder.from_data_dir(tiny_lm_data)
    ds = load_binarized(tiny_lm_data / "valid", enc.dictionary)
    assert tok(text, add_special_tokens=False)["input_ids"] == torch.cat([ds[i] for i in range(len(ds))]).tolist()
    tokens = torch.tensor([tok(text)["input_ids"][:hf.config.max_position_embeddings]])
    with torch.no_grad():
        want = _fairseq_model(ckpt)(tokens)[0]
    assert float((hf(tokens).logits - want).abs().max()) <= 1e-5
    shutil.rmtree(result.folder)
