"""docs/generation.md stays true: every command on the page runs, on a model the page's own commands train.

The module fixture runs each ```bash block of the page once, in order, in a scratch folder (with
`fairseq_plugins` and `configs` linked in, as in a checkout), the training cut to a few updates
(`--max-update 1500` -> 6; fairseq keeps the last value of a repeated flag). The tests then read
what the commands printed: fairseq-interactive on the per-rank set, fairseq-generate, the hub's
sample on the merged file, smlp-generate on one process and on 2 expert-parallel gloo ranks
(torchrun). README's generation command must be one of the page's.
"""
from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "generation.md"
BIN = Path(sys.executable).parent
SHORTEN = ("--max-update 1500", "--max-update 6")


@dataclass
class Ran:
    work: Path                     # the scratch folder the commands ran in
    outputs: list[tuple[str, str]]  # (block, its output), in page order


def doc_blocks(language: str = "bash") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Ran:
    """Every bash block of the page run once, in order: [(block, its output)]."""
    work = tmp_path_factory.mktemp("generation_docs")
    for name in ("fairseq_plugins", "configs"):
        (work / name).symlink_to(REPO / name)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PET_MASTER_PORT=str(_free_port()), PYTHONUNBUFFERED="1")
    out = []
    for block in doc_blocks():
        assert SHORTEN[0] not in block or "smlp-launch" in block
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.replace(*SHORTEN)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{block}\n--- exit {proc.returncode}, output tail ---\n{text[-4000:]}"
        out.append((block, text))
    return Ran(work, out)


def output_of(ran, command: str) -> str:
    """The output of the one block holding `command` (e.g. "| fairseq-interactive", "\ntorchrun ")."""
    (text,) = [text for block, text in ran.outputs if command in "\n" + block]
    return text


@pytest.mark.slow
def test_every_command_of_the_page_runs(ran):
    """The page's blocks, each exited 0 in the fixture: setup (data, 2-rank training, consolidation),
    fairseq-interactive, fairseq-generate, the hub (python), smlp-generate from stdin, from a file,
    and under torchrun."""
    programs = ["\nsmlp-prepare-data ", "| fairseq-interactive ", "\nfairseq-generate ", "\npython - ",
                "| smlp-generate ", "\nsmlp-generate ", "\ntorchrun "]
    assert len(ran.outputs) == len(programs) and all(output_of(ran, p) is not None for p in programs)


def _lines(text: str, tag: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(rf"^{tag}-(\d+)\t(.*)$", text, flags=re.M)}


def _hypotheses(text: str) -> dict[int, str]:
    return {i: line.split("\t", 1)[1] for i, line in _lines(text, "D").items()}


@pytest.mark.slow
def test_fairseq_interactive_reads_the_per_rank_set_and_the_hub_the_merged_file_alike(ran):
    """fairseq-interactive (per-rank set, merged in memory, beam 4) and the hub's sample (the merged file,
    beam 4) continue the same prompts into the same text, which starts with each prompt."""
    inter = output_of(ran, "| fairseq-interactive ")
    assert "is absent: loading its 2 rank shards with the experts merged in memory" in inter
    texts = _hypotheses(inter)
    prompts = ["To be, or not to be", "My lord, the king"]
    assert sorted(texts) == [0, 1] and all(texts[i].startswith(p) for i, p in enumerate(prompts))
    printed = [ast.literal_eval(line) for line in output_of(ran, "\npython - ").splitlines() if line.startswith("['")]
    assert printed[0] == [texts[0], texts[1]]
    assert len(printed) == 2 and printed[1][0].startswith(prompts[0])  # the sampled one


@pytest.mark.slow
def test_the_hub_loads_the_per_rank_set_too(ran, monkeypatch):
    """from_pretrained(..., "checkpoint_last.pt"), a name only the rank shards carry, gives the beam-search
    text the page's hub block printed from the merged file (in this process: no extra launch)."""
    from fairseq.models import FairseqLanguageModel

    import fairseq_plugins  # noqa: F401

    monkeypatch.chdir(ran.work)
    lm = FairseqLanguageModel.from_pretrained("ckpt/plays", "checkpoint_last.pt", data_name_or_path="data-bin/plays",
                                              bpe="sentencepiece", sentencepiece_model="data-bin/plays/spm.model")
    assert not (ran.work / "ckpt" / "plays" / "checkpoint_last.pt").exists()
    printed = [ast.literal_eval(line) for line in output_of(ran, "\npython - ").splitlines() if line.startswith("['")]
    assert lm.eval().sample(["To be, or not to be", "My lord, the king"], beam=4, max_len_b=40) == printed[0]


@pytest.mark.slow
def test_fairseq_generate_continues_every_line_of_the_test_split(ran):
    out = output_of(ran, "\nfairseq-generate ")
    assert "loaded 16 examples" in out and "Generate test with beam=1" in out
    sources, hyps = _lines(out, "S"), _hypotheses(out)
    assert sorted(sources) == sorted(hyps) == list(range(16))


def _continuations(text: str) -> list[str]:
    """smlp-generate's entries: a line `[i] prompt`, then its continuation's indented lines."""
    entries: list[list[str]] = []
    for line in text.splitlines():
        if re.match(r"\[\d+\] ", line):
            entries.append([line])
        elif entries and entries[-1] is not None and line.startswith("  "):
            entries[-1].append(line)
        elif entries:
            entries.append(None)  # anything else ends the entry
    return ["\n".join(e) for e in entries if e is not None]


@pytest.mark.slow
def test_smlp_generate_on_two_expert_parallel_ranks_equals_one_process(ran):
    """The page's torchrun command (2 gloo ranks, one expert of each sparse block per rank) prints the
    continuations of one process, prompt for prompt; samples are seeded per prompt, so the first
    prompt read from stdin alone continues as it does in the file."""
    one, two = output_of(ran, "\nsmlp-generate "), output_of(ran, "\ntorchrun ")
    stdin = output_of(ran, "| smlp-generate ")
    assert "on 1 rank(s)" in one and "on 2 rank(s)" in two
    assert len(_continuations(one)) == 5 and _continuations(one) == _continuations(two)
    assert _continuations(stdin) == _continuations(one)[:1]


def test_readme_generation_command_is_on_the_page():
    """README's Generate subsection shows one command of this page (so the fixture runs it too)."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Generate"):]
    block = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    assert block.strip() and block.strip() in [b.strip() for b in doc_blocks()]
