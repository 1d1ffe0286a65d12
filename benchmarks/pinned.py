"""Runs from a pinned commit (docs/benchmarks.md, "Pinned code"). ADAPTER, run in the commit's worktree, is the
contract a pinned commit must keep: `smlp_bench.presets.plan_models` and `smlp_bench.training.train_command`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .presets import BenchError, models_from_plan

# installed name -> folder of the checkout (pyproject.toml's package-dir); the top-level folders smlp/ and
# fairseq_plugins/ resolve from the worktree's root on the path
LINKS = {"smlp_bench": "benchmarks", "smlp_eval": "eval", "smlp_launch": "launch"}
LINK_DIR = "build/pinned-path"

# Run inside the worktree (python -c, its root the working directory): reads one request (JSON) from the
# file named by argv[1], writes the answer (JSON) to argv[2]. Output files, not stdout: imports print.
ADAPTER = r"""
import json, sys
from pathlib import Path
req = json.loads(Path(sys.argv[1]).read_text())
op = req["op"]
if op == "plan":
    from smlp_bench.presets import plan_models
    models, matching = plan_models(req["vocab_size"], req["nproc"], req["keys"], req["target"])
    out = {"models": [m.as_dict() for m in models], "matching": matching}
elif op == "prediction_start":
    from smlp_eval import flops as F
    out = {"start": F.parse_model("smlp_lm", req["flags"], vocab_size=req["vocab_size"]).cfg.prediction_start}
elif op == "command":
    from smlp_bench.presets import models_from_plan
    from smlp_bench.training import train_command
    model = models_from_plan({"models": [req["model"]]})[0]
    out = {"cmd": train_command(model, Path(req["data"]), req["settings"], req["nproc"], req["seed"],
                                Path(req["out"]), updates=req["updates"], validate=req["validate"],
                                log_interval=req["log_interval"])}
else:
    raise SystemExit(f"unknown request {op!r}")
Path(sys.argv[2]).write_text(json.dumps(out))
"""


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=300)
    if check and res.returncode != 0:
        raise BenchError(f"git {' '.join(args)} in {repo} failed: {(res.stderr or res.stdout).strip()[:400]}")
    return res


@dataclass(frozen=True)
class Checkout:
    """A worktree of one commit whose packages come first on the path of every process started from it."""

    commit: str
    root: Path

    @property
    def env(self) -> dict[str, str]:
        paths = [str(self.root), str(self.root / LINK_DIR)]
        old = os.environ.get("PYTHONPATH")
        return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *([old] if old else [])])}

    def identity(self) -> dict:
        """What a run records of the code it executed."""
        return {"commit": self.commit, "dirty": False, "pinned": True}

    def ask(self, op: str, **request) -> dict:
        """One request to the pinned code (ADAPTER), in a fresh process in the worktree."""
        tmp = self.root / LINK_DIR
        tmp.mkdir(parents=True, exist_ok=True)
        req, ans = tmp / f"request.{os.getpid()}.json", tmp / f"answer.{os.getpid()}.json"
        req.write_text(json.dumps({"op": op, **request}))
        ans.unlink(missing_ok=True)
        try:
            res = subprocess.run([sys.executable, "-c", ADAPTER, str(req), str(ans)], cwd=self.root, env=self.env,
                                 capture_output=True, text=True, timeout=900)
            if res.returncode != 0 or not ans.exists():
                raise BenchError(f"the code of commit {self.commit[:10]} (worktree {self.root}) failed on "
                                 f"'{op}': {(res.stderr or res.stdout).strip()[-1500:]}")
            return json.loads(ans.read_text())
        finally:
            req.unlink(missing_ok=True)
            ans.unlink(missing_ok=True)

    def plan_models(self, vocab_size: int, nproc: int, keys, target: dict) -> tuple[list, dict]:
        """`presets.plan_models`, answered by the pinned commit's code: (models, matching)."""
        answer = self.ask("plan", vocab_size=vocab_size, nproc=nproc, keys=list(keys), target=target)
        return models_from_plan(answer), answer["matching"]

    def train_command(self, model, data: Path, settings: dict, nproc: int, seed: int, out: Path, *,
                      updates: int | None = None, validate: bool = True, log_interval: int | None = None) -> list[str]:
        return self.ask("command", model=model.as_dict(), data=str(data), settings=settings, nproc=nproc, seed=seed,
                        out=str(out), updates=updates, validate=validate, log_interval=log_interval)["cmd"]


RESUME = "to resume the stage pinned to it"


def resolve(commit: str, repo: Path, why: str = RESUME) -> str:
    """The full hash of `commit` in the repository at `repo`; refused, saying `why` it is needed, where the repository
    does not have it."""
    full = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", check=False).stdout.strip()
    if not full:
        raise BenchError(f"commit {commit[:10]} is not in the repository at {repo}: fetch it (git fetch) {why}")
    return full


def checkout(commit: str, work_dir: Path, repo: Path, why: str = RESUME) -> Checkout:
    """The worktree of `commit` (of the repository at `repo`) under work_dir/code/, made once and reused; the
    installed package names linked to its folders. Refuses a worktree someone changed."""
    full = resolve(commit, repo, why)
    root = (Path(work_dir) / "code" / full[:12]).absolute()
    if root.exists():
        head = _git(root, "rev-parse", "HEAD", check=False).stdout.strip()
        if head != full:
            raise BenchError(f"{root} should be a worktree of commit {full[:10]} but holds "
                             f"{head[:10] or 'no checkout'}: remove it (git worktree remove --force {root}) and "
                             f"run again")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip()
        if changed:
            raise BenchError(f"the pinned worktree {root} has changes ({changed.splitlines()[0].strip()} ...): its "
                             f"runs must execute commit {full[:10]} as committed; undo them (git -C {root} "
                             f"checkout -- .) and run again")
    else:
        root.parent.mkdir(parents=True, exist_ok=True)
        _git(repo, "worktree", "prune")  # a worktree folder deleted by hand leaves its entry behind
        _git(repo, "worktree", "add", "--detach", str(root), full)
    links = root / LINK_DIR
    links.mkdir(parents=True, exist_ok=True)
    for name, folder in LINKS.items():
        link = links / name
        if link.is_symlink() and Path(os.readlink(link)) == root / folder:
            continue
        if link.is_symlink():
            link.unlink()
        link.symlink_to(root / folder, target_is_directory=True)
    return Checkout(full, root)


def environment_changes(repo: Path, old: str, new: str) -> bool:
    """Whether pyproject.toml (the environment the pinned code runs in: the installed one) changed between
    two commits."""
    return bool(_git(repo, "diff", "--name-only", old, new, "--", "pyproject.toml", check=False).stdout.strip())
