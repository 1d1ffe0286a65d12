"""README.md and docs/*.md stay true without training anything: every command parses, every flag and file exists.

Commands that train or evaluate are too slow to run here, so each ```bash command of the pages is
checked as far as it can be without doing the work:

- our console scripts and `python -m` / `torchrun -m` modules: the program's own argument parser
  reads the command's arguments (the program stops right after parsing; a bad flag or value fails
  with argparse's message);
- fairseq-train arguments (after `smlp-launch ... --`, after `train.sbatch DATA SAVE`, after `torchrun ...
  $(which fairseq-train)`, with the `$(cat configs/X.args)` recipes expanded), `fairseq-eval-lm` and
  `fairseq-validate`: fairseq's own parser with our plugins, model and criterion arguments included
  (`parse_args_and_arch`);
- `make` targets exist in the Makefile, `pip install` pins are the Makefile's;
- what the page does not run here is run elsewhere: `smlp-flops` by tests/test_flops.py, every command
  of docs/generation.md by tests/test_generation_docs.py (which trains once for the whole page).

Then, in the prose: every `--flag` in backticks is an option of one of those parsers (or of a named
external tool), every repository path in backticks exists, and every relative link and #anchor
resolves.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# pages whose commands another test runs for real (this file still checks their links, paths and flags)
RUN_ELSEWHERE = {"generation.md": "tests/test_generation_docs.py"}
PROGRAMS_RUN_ELSEWHERE = {"smlp-flops": "tests/test_flops.py"}  # each command runs there (closed-form count)
SHELL = {"echo", "printf", "cat"}  # feeding a pipeline
INSTALL = {"python3", "pip", "."}  # the install block: checked against the Makefile instead
PLACE = {"git", "cd"}  # choosing the checkout a command runs in, before `&&`


class Parsed(Exception):
    """Raised instead of returning from a parser: the program stops right after reading its arguments."""

    def __init__(self, parser: argparse.ArgumentParser, extra: list[str]):
        super().__init__(parser.prog)
        self.parser, self.extra = parser, extra


@contextlib.contextmanager
def stop_after_parsing(parse: bool = True):
    """Within: the first parser a program asks to read its arguments raises Parsed, after reading them
    (a refused argument exits as usual) or, with parse=False, before (to collect the parser's options)."""
    original_known, original_args = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args

    def parse_known_args(self, args=None, namespace=None):
        if not parse:
            raise Parsed(self, [])
        ns, extra = original_known(self, args, namespace)
        raise Parsed(self, extra)

    def parse_args(self, args=None, namespace=None):
        if not parse:
            raise Parsed(self, [])
        ns, extra = original_known(self, args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise Parsed(self, [])

    argparse.ArgumentParser.parse_known_args = parse_known_args
    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original_known
        argparse.ArgumentParser.parse_args = original_args


def _expand_recipes(line: str) -> str:
    """`$(cat configs/X.args)` -> the recipe's flags (the file must exist); `$(which PROG)` -> PROG."""
    def read(m):
        path = REPO / m.group(1)
        assert path.is_file(), f"{m.group(0)}: {path} does not exist"
        return " ".join(path.read_text().split())
    line = re.sub(r"\$\(which ([\w-]+)\)", r"\1", line)  # `torchrun ... $(which fairseq-train)`: the program
    return re.sub(r"\$\(cat ([^)]+)\)", read, line)


def page_commands(page: Path) -> list[list[str]]:
    return commands_in(page.read_text(), page.name)


def commands_in(text: str, name: str) -> list[list[str]]:
    """Each command of the ```bash blocks as argv lists; a pipeline `a | b` gives b (a must be in SHELL).
    Comments and line continuations are handled as the shell does; heredocs are skipped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        if "<<" in block:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = _expand_recipes(line.strip())
            if not line or line.startswith("#"):
                continue
            lex = shlex.shlex(line, posix=True, punctuation_chars="|&;")
            lex.whitespace_split, lex.commenters = True, "#"
            segments, current = [], []
            for tok in lex:
                if tok in ("|", "&&", ";"):
                    segments.append(current)
                    current = []
                else:
                    current.append(tok)
            segments.append(current)
            for seg in segments[:-1]:
                if seg and seg[0] == "make":  # a make target on the way: checked like any other
                    commands.append(seg)
                    continue
                assert seg and seg[0] in SHELL | INSTALL | PLACE, f"{name}: cannot check `{line}`"
            commands.append(segments[-1])
    return commands


def _strip_env(argv: list[str]) -> list[str]:
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]
    return argv


def _console_scripts() -> dict:
    return {ep.name: ep for ep in entry_points(group="console_scripts")}


@pytest.fixture(scope="module")
def fairseq_parse(monkeypatch_module):
    """fairseq's parsers with our plugins; returns (parse(kind, argv) -> parser) and the option strings seen."""
    from fairseq import options

    monkeypatch_module.chdir(REPO)  # `--user-dir fairseq_plugins` as written on the pages
    seen: set[str] = set()
    makers = {"train": options.get_training_parser, "eval-lm": options.get_eval_lm_parser,
              "validate": options.get_validation_parser, "generate": options.get_generation_parser,
              "interactive": options.get_interactive_generation_parser}

    def parse(kind: str, argv: list[str]):
        parser = makers[kind]()
        options.parse_args_and_arch(parser, input_args=argv)  # argparse errors raise SystemExit(2)
        seen.update(parser._option_string_actions)
        return parser

    # every model family and criterion, so that the prose's flags can be looked up
    # and fairseq's own transformer_lm, the benchmark's anchor (--base-layers)
    for arch in ("smlp_lm_tiny", "gmlp_lm_tiny", "moe_transformer_lm", "transformer_lm"):
        parse("train", ["data", "--user-dir", "fairseq_plugins", "--task", "language_modeling", "--arch", arch,
                        "--criterion", "smlp_lm_loss"])
    for kind in ("generate", "interactive"):  # docs/generation.md's flags
        parse(kind, ["data", "--user-dir", "fairseq_plugins", "--task", "language_modeling"])
    return parse, seen


def _our_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of each console script of this project, taken before it reads anything."""
    out = {}
    for name, ep in _console_scripts().items():
        if ep.value.split(".")[0] in ("smlp_launch", "smlp_eval", "smlp_bench", "fairseq_plugins"):
            saved = sys.argv
            sys.argv = [name]
            try:
                with stop_after_parsing(parse=False):
                    ep.load()()
            except Parsed as p:
                out[name] = p.parser
            finally:
                sys.argv = saved
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _run_parser_only(target, argv: list[str], prog: str) -> Parsed:
    """Call a program with argv and stop it after its parser read them; return what was parsed."""
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        with stop_after_parsing():
            target()
    except Parsed as p:
        return p
    except SystemExit as e:
        raise AssertionError(f"{prog} {shlex.join(argv)}: its parser refused the arguments (exit {e.code})") from e
    finally:
        sys.argv = saved
    raise AssertionError(f"{prog} {shlex.join(argv)}: returned without parsing its arguments")


def _module_main(module: str):
    """What `python -m module` runs: the function its `if __name__ == "__main__":` block calls (each reads
    sys.argv), without executing the module a second time."""
    mod = importlib.import_module(module)
    m = re.search(r'^if __name__ == "__main__":\n\s+(?:sys\.exit\(|raise SystemExit\()?(\w+)\(',
                  Path(mod.__file__).read_text(), flags=re.M)
    assert m, f"{module} has no `if __name__ == \"__main__\":` block calling its entry function"
    return getattr(mod, m.group(1))


def _check_fairseq_train(argv: list[str], parse, where: str) -> None:
    """fairseq-train arguments as smlp-launch and train.sbatch pass them."""
    assert "--user-dir" in argv and "--arch" in argv, f"{where}: no --user-dir / --arch in {argv}"
    parse("train", argv)


def check_command(argv: list[str], parse, parsers: dict, where: str) -> str:
    """Check one command; returns how (for the summary)."""
    argv = _strip_env(argv)
    prog, args = argv[0], argv[1:]
    scripts = _console_scripts()
    if prog in PROGRAMS_RUN_ELSEWHERE:
        p = _run_parser_only(scripts[prog].load(), args, prog)  # its own flags; the model flags run there
        parsers[prog] = p.parser
        return f"parsed; run by {PROGRAMS_RUN_ELSEWHERE[prog]}"
    if prog == "make":
        makefile = (REPO / "Makefile").read_text()
        for target in (a for a in args if "=" not in a):
            assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"{where}: no make target {target}"
        return "make target"
    if prog in ("python3", "pip", "."):
        return _check_install(argv, where)
    if prog == "smlp-launch":
        own, fairseq_args = args[:args.index("--")], args[args.index("--") + 1:]
        p = _run_parser_only(scripts[prog].load(), [*own, "--", *fairseq_args], prog)
        assert not p.extra, f"{where}: smlp-launch does not know {p.extra}"
        parsers[prog] = p.parser
        _check_fairseq_train(fairseq_args, parse, where)
        return "launcher and fairseq-train parsed"
    if prog == "sbatch":
        script = next(a for a in args if a.endswith(".sbatch"))
        assert (REPO / script).is_file(), f"{where}: {script} does not exist"
        data, save, *rest = args[args.index(script) + 1:]
        _check_fairseq_train([data, "--user-dir", "fairseq_plugins", *rest, "--save-dir", save], parse, where)
        return "sbatch script exists, fairseq-train parsed"
    if prog in ("fairseq-eval-lm", "fairseq-validate"):
        parse("eval-lm" if prog == "fairseq-eval-lm" else "validate", args)
        return "fairseq parsed"
    if prog == "torchrun" and any(a in ("fairseq-train", "fairseq-validate") for a in args):
        i = next(i for i, a in enumerate(args) if a in ("fairseq-train", "fairseq-validate"))
        if args[i] == "fairseq-train":
            _check_fairseq_train(args[i + 1:], parse, where)
        else:
            parse("validate", args[i + 1:])
        return "torchrun's fairseq program parsed"
    if prog == "torchrun":
        assert "-m" in args, f"{where}: torchrun without -m"
        args = args[args.index("-m"):]
        prog = "python"
    if prog == "python":
        assert args[0] == "-m", f"{where}: only `python -m MODULE` is checked"
        module, margs = args[1], args[2:]
        p = _run_parser_only(_module_main(module), margs, module)
        assert not p.extra, f"{where}: {module} does not know {p.extra}"
        parsers[module] = p.parser
        return "module parsed"
    assert prog in scripts, f"{where}: `{prog}` is neither a console script of this project nor a known tool"
    p = _run_parser_only(scripts[prog].load(), args, prog)
    assert not p.extra, f"{where}: {prog} does not know {p.extra}"
    parsers[p.parser.prog] = p.parser  # a command's subcommand parser under its own name (smlp-bench fair)
    return "parsed"


def _check_install(argv: list[str], where: str) -> str:
    makefile = (REPO / "Makefile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    for arg in argv:
        if "==" in arg:  # the same pins as `make install`
            assert arg in makefile, f"{where}: {arg} is not the Makefile's pin"
        m = re.match(r"^\.\[(\w+)\]$", arg)
        if m:
            assert re.search(rf"^{m.group(1)} = \[", pyproject, flags=re.M), f"{where}: no extra [{m.group(1)}]"
    return "install pins"


@pytest.fixture(scope="module")
def checked(fairseq_parse):
    """Every command of every page checked once; the parsers met on the way (for the prose's flags)."""
    parse, seen = fairseq_parse
    parsers = _our_parsers()
    assert {"smlp-launch", "smlp-zeroshot", "smlp-flops", "smlp-demo", "smlp-bench"} <= set(parsers)
    report = []
    for page in PAGES:
        if page.name in RUN_ELSEWHERE:
            continue
        for argv in page_commands(page):
            report.append((page.name, argv[0], check_command(argv, parse, parsers, f"{page.name}: {shlex.join(argv)}")))
    return report, parsers, seen


def test_every_command_on_the_pages_parses(checked):
    report, parsers, _ = checked
    pages = {page for page, _, _ in report}
    assert {"README.md", "training.md", "evaluation.md", "scale-out.md", "benchmarks.md"} <= pages
    programs = {prog for _, prog, _ in report}
    assert {"smlp-launch", "sbatch", "smlp-zeroshot", "smlp-consolidate", "fairseq-eval-lm", "smlp-bench",
            "torchrun", "smlp-prepare-data", "make"} <= programs


def test_the_checker_refuses_a_bad_flag_and_a_bad_fairseq_flag(fairseq_parse):
    """The checks above can fail: an unknown option of our program and of fairseq-train are refused."""
    parse, _ = fairseq_parse
    with pytest.raises(AssertionError, match="refused"):
        check_command(["smlp-zeroshot", "--path", "CKPT", "--no-such-flag"], parse, {}, "test")
    with pytest.raises(SystemExit):
        check_command(["smlp-launch", "--nproc", "2", "--cpu", "--", "data", "--user-dir", "fairseq_plugins",
                       "--arch", "smlp_lm_tiny", "--no-such-flag", "1"], parse, {}, "test")
    with pytest.raises(AssertionError, match="configs/nope.args"):
        commands_in("```bash\nsmlp-launch -- d --user-dir fairseq_plugins $(cat configs/nope.args)\n```", "test")
    # a recipe is expanded, a pipeline gives its last program, a comment is dropped
    assert commands_in("```bash\necho x | smlp-generate --path $(cat configs/smlp_tiny.args)  # c\n```", "t")[0][:4] \
        == ["smlp-generate", "--path", "--arch", "smlp_lm_tiny"]


# flags of tools that are not ours, named where the pages use them
EXTERNAL_FLAGS = {
    "sbatch/srun": {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--gpus-per-task", "--time", "--partition",
                    "--cpus-per-task", "--requeue", "--kill-on-bad-exit"},
    "pip": {"--no-build-isolation", "--no-deps"},
    "torchrun": {"--nproc_per_node"},
    "lm-eval": {"--model", "--model_args", "--tasks", "--include_path", "--output_path"},
}


def _prose_flags(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # commands are checked above
    flags = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        flags.update(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", span))
    return flags


def test_every_flag_named_in_the_prose_exists(checked):
    _, parsers, seen = checked
    known = set(seen) | set().union(*EXTERNAL_FLAGS.values())
    for parser in parsers.values():
        known.update(parser._option_string_actions)
    unknown = {page.name: sorted(_prose_flags(page) - known) for page in PAGES}
    assert not {k: v for k, v in unknown.items() if v}, unknown


REPO_PATH = re.compile(r"^(?:smlp|fairseq_plugins|launch|eval|benchmarks|configs|tests|docs)/[\w./{},-]*$")


def test_every_repository_path_and_link_exists():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for span in re.findall(r"`([^`\n]+)`", text):
            path, _, test = span.partition("::")
            if not REPO_PATH.match(path) or "{" in path:
                continue
            if not (REPO / path).exists():
                missing.append(f"{page.name}: `{span}`")
            elif test and f"def {test}(" not in (REPO / path).read_text():
                missing.append(f"{page.name}: `{span}` (no such test)")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            dest = (page.parent / target).resolve() if target else page
            if not dest.exists():
                missing.append(f"{page.name}: link {target}")
            elif anchor and anchor not in _anchors(dest):
                missing.append(f"{page.name}: link {target}#{anchor}")
    assert not missing, missing


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)}


def test_readme_results_paragraph_says_what_the_published_record_says():
    """README's Results paragraph is typed (the generated tables live in docs/benchmarks.md): its figures
    must be those of the record docs/benchmarks.md is generated from, or be rewritten with it."""
    import json

    rec = json.loads((REPO / "docs" / "benchmark" / "results.json").read_text())
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Results"):readme.index("\n## ", readme.index("## Results") + 1)]
    s, t = rec["settings"], rec["target"]
    seeds = f"{s['seeds']} seed" + ("s" if s["seeds"] > 1 else "")
    assert f"{rec['preset']} preset: D={t['d_model']}, {s['updates']} updates, {seeds}" in " ".join(section.split())
    speed = next(x for x in rec["targets"] if x["target"].startswith("sMLP-det words/s over the fastest MoE"))
    fastest = rec["ratios"]["fastest_moe_baseline"]
    assert speed["target"].endswith(f"({fastest})")
    assert f"ran at {speed['measured']:.2f}x {rec['models'][fastest]['name']}'s words/s" in " ".join(section.split())
    ppl = {k: m["valid_ppl"] for k, m in rec["models"].items()}
    assert "ended below every Transformer-MoE baseline in perplexity" in " ".join(section.split())
    assert all(ppl["smlp_det"] < ppl[k] for k in ("gshard", "switch", "base", "hash"))


def test_readme_speed_sentence_is_the_width_records():
    """README's speed sentence states the width trend (issue 53): it is `widths_sentence` of the committed record
    of several widths, so the figures move with the record."""
    import json

    from smlp_bench.speed_pages import widths_sentence

    record = json.loads((REPO / "docs" / "benchmark" / "speed" / "widths" / "speed.json").read_text())
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Results"):readme.index("\n## ", readme.index("## Results") + 1)]
    sentence = widths_sentence(record)
    assert sentence in " ".join(section.split()), sentence


CITED_FILE = re.compile(r"(?<![\w./-])([\w./-]+\.(?:py|md|sh|sbatch))\b")


def exported_file_names() -> set[str]:
    """The files smlp-export writes into an exported folder (eval/hf_export.py's *_FILE constants): the code
    names them, the repository does not hold them."""
    import ast

    tree = ast.parse((REPO / "eval" / "hf_export.py").read_text())
    return {node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and any(isinstance(t, ast.Name) and t.id.endswith("_FILE") for t in node.targets)
            and isinstance(node.value.value, str) and node.value.value.endswith(".py")}


def cited_files_missing(source: str, folder: Path) -> list[str]:
    """File names cited in `source` (a module of `folder`) that the repository does not hold: a path is read
    from the repository root or from the module's folder (a sibling named alone); the files an export writes
    are named by the code that writes them."""
    generated = exported_file_names()
    return [path for path in CITED_FILE.findall(source)
            if not (REPO / path).exists() and not (folder / path).exists() and path not in generated]


def test_the_code_cites_only_files_of_the_repository():
    """Docstrings and comments of the packages name files that exist (issue 27): after a move, a stale path
    fails here; code outside the repository is named by its module (`fairseq.utils`), not a file."""
    assert cited_files_missing("see routes.py and smlp/dispatch.py", REPO / "smlp" / "routing") == []
    assert cited_files_missing("(smlp/routers_old.py, token_routed.py)", REPO / "smlp" / "routing") == [
        "smlp/routers_old.py", "token_routed.py"]
    assert exported_file_names() == {"modeling_smlp.py", "tokenization_smlp.py"}
    assert cited_files_missing("modeling_smlp.py from smlp_eval/hf_modeling.py", REPO / "eval") == [
        "smlp_eval/hf_modeling.py"]
    missing = {}
    for package in ("smlp", "fairseq_plugins", "eval"):
        for path in sorted((REPO / package).rglob("*.py")):
            found = cited_files_missing(path.read_text(), path.parent)
            if found:
                missing[str(path.relative_to(REPO))] = found
    assert not missing, missing
