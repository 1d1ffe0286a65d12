"""configs/hydra/NAME.yaml from configs/NAME.args: each training recipe as a fairseq-hydra-train configuration.

    python -m smlp_launch.hydra_configs          # (re)writes configs/hydra/ from configs/*.args (from the root)
    fairseq-hydra-train task.data=data-bin/mycorpus --config-dir configs/hydra --config-name smlp_tiny

A recipe is parsed by fairseq-train's own parser (the plugins' flags included). Its configuration holds, under
fairseq's section names, every value that differs from what fairseq-train takes given only the recipe's
--task, --arch, --criterion, --optimizer and --lr-scheduler; the model's `_name` is the recipe's architecture,
whose preset fills the rest (fairseq_plugins/hydra_presets.py), and interpolated fields stay interpolated.
`task.data` is left to the command line (`???`); the run stays in the current folder (`hydra.run.dir: .`), so
that `common.user_dir: fairseq_plugins` is found from the root, and logs as fairseq-train does.
tests/test_fairseq_habits.py checks that the files are current and that fairseq-hydra-train builds each
recipe's model.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import shlex
import sys
from pathlib import Path

__all__ = ["SECTIONS", "hydra_config", "hydra_yaml", "main"]

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("common", "task", "model", "criterion", "optimizer", "lr_scheduler", "dataset", "optimization",
            "checkpoint", "distributed_training")
NAMED = {"task": "--task", "model": "--arch", "criterion": "--criterion", "optimizer": "--optimizer",
         "lr_scheduler": "--lr-scheduler"}  # sections chosen by name, and the flag that names each
# the run stays in the current folder and logs as fairseq-train does (smlp_launch.fairseq_log reads its lines),
# to the console only (no hydra_train.log, no .hydra/ folder)
HYDRA = {"run": {"dir": "."}, "output_subdir": None,
         "job_logging": {"formatters": {"simple": {"format": "%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                                                   "datefmt": "%Y-%m-%d %H:%M:%S"}},
                         "handlers": {"file": {"delay": True}}, "root": {"handlers": ["console"]}}}
HEADER = ("# configs/{name}.args for fairseq-hydra-train, written by python -m "
          "smlp_launch.hydra_configs: edit the recipe, then run it again\n")


def _config(flags: list[str]) -> dict:
    """fairseq-train's configuration of `flags` as plain containers, interpolations unresolved."""
    import copy

    return copy.deepcopy(_parsed(tuple(flags)))


@functools.lru_cache(maxsize=64)  # fairseq's parse takes a second; the base of many recipes is the same
def _parsed(flags: tuple[str, ...]) -> dict:
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    plugins = str(REPO / "fairseq_plugins")
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(sys.stderr):
        args = options.parse_args_and_arch(options.get_training_parser(), ["DATA", "--user-dir", plugins, *flags])
        cfg = convert_namespace_to_omegaconf(args)
    return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)


def _value(flags: list[str], flag: str) -> str | None:
    return next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f == flag), None)


def _interpolated(section: str, name: str | None) -> set[str]:
    """The fields of a section whose dataclass default interpolates another section's (`II(...)`: a model's
    --tokens-per-sample is the task's): a recipe leaves them to that section."""
    import dataclasses

    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY, MODEL_DATACLASS_REGISTRY
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    if section == "model":
        dc = MODEL_DATACLASS_REGISTRY.get(ARCH_MODEL_NAME_REGISTRY.get(name, name))
    elif section == "task":
        dc = TASK_DATACLASS_REGISTRY.get(name)
    elif section in REGISTRIES:
        dc = REGISTRIES[section]["dataclass_registry"].get(name)
    else:
        field = FairseqConfig.__dataclass_fields__[section]
        dc = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if dc is None or not dataclasses.is_dataclass(dc):
        return set()
    return {f.name for f in dataclasses.fields(dc) if isinstance(f.default, str) and f.default.startswith("${")}


def hydra_config(flags: list[str]) -> dict:
    """The fairseq-hydra-train configuration of a recipe's fairseq-train flags (module docstring)."""
    full = _config(flags)
    named = [x for flag in NAMED.values() if (v := _value(flags, flag)) is not None for x in (flag, v)]
    base = _config(named)
    out: dict = {"hydra": HYDRA, "common": {"user_dir": "fairseq_plugins"}, "task": {"data": "???"}}
    for section in SECTIONS:
        linked = _interpolated(section, (full.get(section) or {}).get("_name"))
        given = {k: v for k, v in (full.get(section) or {}).items()
                 if k != "_name" and k not in linked and v != (base.get(section) or {}).get(k)}
        if section in NAMED and (full.get(section) or {}).get("_name") is not None:
            given = {"_name": full[section]["_name"], **given}
        if given:
            out[section] = {**out.get(section, {}), **given}
    out["task"] = {"_name": out["task"].pop("_name", "language_modeling"), **out["task"]}
    return out


def hydra_yaml(recipe: Path) -> str:
    """The configs/hydra/ file of the recipe `recipe` (configs/NAME.args)."""
    from omegaconf import OmegaConf

    flags = shlex.split(recipe.read_text())
    return HEADER.format(name=recipe.stem) + OmegaConf.to_yaml(OmegaConf.create(hydra_config(flags)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smlp_launch.hydra_configs", description=__doc__.split("\n")[0])
    p.add_argument("--recipes", type=Path, default=REPO / "configs", help="the folder of the *.args recipes")
    p.add_argument("--out", type=Path, default=None, help="where the YAML files go (RECIPES/hydra)")
    args = p.parse_args(argv)
    from smlp.files import write_atomic

    out = args.out or args.recipes / "hydra"
    out.mkdir(parents=True, exist_ok=True)
    for recipe in sorted(args.recipes.glob("*.args")):
        write_atomic(out / f"{recipe.stem}.yaml", hydra_yaml(recipe))
        print(f"wrote {out / recipe.stem}.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
