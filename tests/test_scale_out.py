"""Scale out through the real fairseq-train: expert-data parallelism and elastic resume.

One 4-expert HASH model (its routing depends only on the token ids, not on where tokens are) and
one global batch of 4 x 8 sequences throughout (W ranks x --update-freq 4/W):

    reference    4 ranks, --expert-parallel-size 4 (one expert per rank), updates 1-7
    replicated   4 ranks, --expert-parallel-size 2 (2 replicas of 2 experts per rank), updates 1-3
    shrunk       resumed from `replicated` on 1 process, --update-freq 4, updates 4-5
    regrown      resumed from `shrunk` on 2 ranks, --update-freq 2, --zero-sharding os, updates 6-7
    again        resumed from `regrown` on 1 process, --update-freq 4, update 8

Every run must log the reference's per-update losses (Adam: the moments of the expert weights
are resharded with them; with --zero-sharding os the non-expert moments are split over the ranks
and gathered into every rank's checkpoint), and the 4-rank checkpoints with replicated experts
consolidate into the model the reference holds at the same update.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, run_fairseq, run_in_process, train_losses

pytestmark = pytest.mark.slow

HASH = ["--arch", "hash_layers_lm_tiny", "--num-experts", "4", "--disable-validation"]


def _train(data, save_dir, world, *extra):
    args = [str(data), "--user-dir", PLUGINS, *TINY_TRAIN, *HASH, *extra, "--save-dir", str(save_dir)]
    if world > 1:
        res = run_fairseq("fairseq-train", args, world=world, timeout=600)
    else:  # in this process: no start-up, the same run, its log collected as fairseq prints it
        res = run_in_process("fairseq-train", args)
    text = assert_ok(res)
    return train_losses(res[0].stdout), text


@pytest.fixture(scope="module")
def runs(tiny_lm_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("scale_out")
    out = {"root": root}
    out["reference"] = _train(tiny_lm_data, root / "ref", 4, "--expert-parallel-size", "4", "--max-update", "8",
                              "--save-interval-updates", "3")
    out["replicated"] = _train(tiny_lm_data, root / "elastic", 4, "--expert-parallel-size", "2",
                               "--max-update", "3")
    # writes of ranks 0, 2 and 3 killed partway (a run stopped while it saved): the 1-process run has none of them
    out["planted"] = [f".checkpoint_{n}-rank-{r}.pt.smlp-tmp-{r:016x}" for n, r in (("last", 0), ("1_3", 2),
                                                                                    ("last", 3))]
    for name in out["planted"]:
        (root / "elastic" / name).write_bytes(b"PK\x03\x04 part of a checkpoint")
    # the 4-rank set, as the resumed runs find it (a later save of that name supersedes it)
    shutil.copytree(root / "elastic", root / "four", ignore=shutil.ignore_patterns(".*"))
    out["shrunk"] = _train(tiny_lm_data, root / "elastic", 1, "--update-freq", "4", "--max-update", "5")
    out["shrunk_files"] = sorted(p.name for p in (root / "elastic").iterdir())
    out["regrown"] = _train(tiny_lm_data, root / "elastic", 2, "--update-freq", "2", "--max-update", "7",
                            "--zero-sharding", "os")
    out["regrown_files"] = sorted(p.name for p in (root / "elastic").iterdir())
    out["again"] = _train(tiny_lm_data, root / "elastic", 1, "--update-freq", "4", "--max-update", "8")
    return out


def test_expert_parallel_size_2_logs_the_losses_of_size_4(runs):
    ref, _ = runs["reference"]
    got, text = runs["replicated"]
    assert sorted(got) == [1, 2, 3], text[-3000:]
    assert got == pytest.approx({u: ref[u] for u in got}, abs=2e-3), (got, ref)
    assert 9.0 < got[1] < 12.0, got


def test_replicated_shards_consolidate_into_the_reference_model(runs, tmp_path):
    """Ranks 2, 3 hold replicas of ranks 0, 1: consolidation merges 2 of the 4 shards (and checks the
    replicas agree); the result equals the reference's 4 one-expert shards merged, at update 3."""
    from fairseq_plugins.checkpoints import consolidate, load_checkpoint

    root = runs["root"]
    four = root / "four"  # the 4-rank set, copied before the 1-process run resumed from it
    assert sorted(p.name for p in four.iterdir()) == [f"checkpoint_last-rank-{r}.pt" for r in range(4)]
    mine = load_checkpoint(consolidate(str(four / "checkpoint_last.pt"), str(tmp_path / "mine.pt")))
    theirs = load_checkpoint(consolidate(str(root / "ref" / "checkpoint_1_3.pt"), str(tmp_path / "ref.pt")))
    assert mine["model"].keys() == theirs["model"].keys()
    experts = [k for k in mine["model"] if ".experts." in k]
    assert experts and all(mine["model"][k].shape[0] == 4 for k in experts)
    for k, v in theirs["model"].items():
        torch.testing.assert_close(mine["model"][k], v, atol=2e-5, rtol=1e-4, msg=k)


def test_the_last_saves_of_a_shard_set_average_into_one_checkpoint(runs, tmp_path, capsys):
    """`smlp-consolidate DIR --num-update-checkpoints 2 --out F` on the 4-rank run's folder: its two numbered saves
    (rank shards at updates 6 and 3, which fairseq's scripts/average_checkpoints.py does not find) each merged and
    averaged, equal to the average of the two merged models by hand (HASH's integer table, equal in both, kept);
    asking for more saves than the folder holds, or for no --out, is refused in one line."""
    from fairseq_plugins.checkpoints import consolidate, load_checkpoint
    from smlp_launch.consolidate import consolidate_main

    ref = runs["root"] / "ref"
    out = tmp_path / "averaged.pt"
    assert consolidate_main([str(ref), "--num-update-checkpoints", "2", "--out", str(out)]) == 0
    assert "the average of checkpoint_1_6.pt, checkpoint_1_3.pt" in capsys.readouterr().out
    six, three = (load_checkpoint(consolidate(str(ref / f"checkpoint_1_{u}.pt"), str(tmp_path / f"{u}.pt")))["model"]
                  for u in (6, 3))
    averaged = load_checkpoint(str(out))
    assert averaged["model"].keys() == six.keys() and averaged["optimizer_history"][-1]["num_updates"] == 6
    for k, v in six.items():
        by_hand = ((v.float() + three[k].float()) / 2).to(v.dtype) if v.is_floating_point() else v
        assert torch.equal(averaged["model"][k], by_hand), k
    assert any(not v.is_floating_point() for v in six.values())  # the HASH table
    assert not torch.equal(six["decoder.core.embed.weight"], three["decoder.core.embed.weight"])
    assert consolidate_main([str(ref), "--num-update-checkpoints", "3", "--out", str(tmp_path / "x.pt")]) == 2
    assert "holds 2 update save(s) (3, 6), fewer than --num-update-checkpoints 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        consolidate_main([str(ref), "--num-update-checkpoints", "2"])
    assert "give it with --out" in capsys.readouterr().err


def test_resume_on_one_process_continues_the_losses(runs):
    ref, _ = runs["reference"]
    got, text = runs["shrunk"]
    assert "resharded checkpoint_last.pt (4 rank shards from a 4-rank run, 4 experts in groups of 2" in text, \
        text[-3000:]
    assert sorted(got) == [4, 5], text[-3000:]
    assert got == pytest.approx({u: ref[u] for u in got}, abs=2e-3), (got, ref)
    # one process reads one file, resharded beside the set; once this run saved checkpoint_last.pt, the 4-rank
    # checkpoint_last-rank-* it supersedes and the resharded copy are gone
    assert "into checkpoint_resharded_3_w1.pt; the source is unchanged" in text, text[-3000:]
    assert [n for n in runs["shrunk_files"] if n.startswith("checkpoint")] == ["checkpoint_last.pt"], \
        runs["shrunk_files"]


def test_resuming_on_fewer_ranks_removes_the_temporary_files_of_every_rank_it_does_not_have(runs):
    """Killed writes of ranks a resharded run does not have would be left for good (each up to a checkpoint in
    size): rank 0, holding the folder's lock, removes every rank's when training starts, and says so."""
    _, text = runs["shrunk"]
    assert not set(runs["planted"]) & set(runs["shrunk_files"]), runs["shrunk_files"]
    for name in runs["planted"]:
        assert f"removed {name} (0.0 MiB): a write that never finished" in text, text[-3000:]


def test_resume_on_two_ranks_with_sharded_optimizer_state_continues_the_losses(runs):
    ref, _ = runs["reference"]
    got, text = runs["regrown"]
    assert "resharded checkpoint_last.pt (one file from a 1-rank run" in text, text[-3000:]
    assert "--zero-sharding os: the optimizer state of" in text, text[-3000:]
    assert sorted(got) == [6, 7], text[-3000:]
    assert got == pytest.approx({u: ref[u] for u in got}, abs=2e-3), (got, ref)
    files = runs["regrown_files"]
    assert [f for f in files if f.startswith("checkpoint_last")] == ["checkpoint_last-rank-0.pt",
                                                                      "checkpoint_last-rank-1.pt"], files


def test_sharded_optimizer_state_checkpoint_resumes_on_one_process(runs):
    """Every rank's shard holds the whole Adam state (the non-expert share gathered from all ranks)."""
    ref, _ = runs["reference"]
    got, text = runs["again"]
    assert "resharded checkpoint_last.pt (2 rank shards from a 2-rank run, 4 experts in groups of 2" in text
    assert sorted(got) == [8], text[-3000:]
    assert got == pytest.approx({8: ref[8]}, abs=2e-3), (got, ref)


def test_resume_that_would_change_the_number_of_experts_is_refused(runs):
    """--num-experts 0 means one per rank: on 2 ranks that is 2 experts, not the checkpoint's 4."""
    from fairseq_plugins.elastic import ReshardError, plan_resume
    from smlp.expert_data_parallel import ExpertDataLayout

    base = str(runs["root"] / "elastic" / "checkpoint_last.pt")
    with pytest.raises(ReshardError,
                       match="holds 4 experts per sparse layer but this run builds 2.*Pass --num-experts 4"):
        plan_resume(base, world_size=2, sharded=True, layout=ExpertDataLayout(world_size=2, ep_size=2, num_experts=2),
                    num_experts=2)
    # the layout it was saved in (one process) needs nothing; 2 ranks in groups of 2 or of 1 do
    assert plan_resume(base, world_size=1, sharded=False, num_experts=4,
                       layout=ExpertDataLayout(world_size=1, ep_size=1, num_experts=4)) is None
    for G in (2, 1):
        plan = plan_resume(base, world_size=2, sharded=True, num_experts=4,
                           layout=ExpertDataLayout(world_size=2, ep_size=G, num_experts=4))
        assert (plan.saved.world_size, plan.target.ep_size, len(plan.targets)) == (1, G, 2)


def test_a_model_with_its_own_smoe_experts_reshards_consolidates_and_exports(tiny_lm_data, tmp_path, monkeypatch):
    """--smoe-experts 2 apart from --num-experts 4 on 2 ranks, the sMoE replicated: every rank file holds 2 sMoE
    and 2 tMoE experts of each sparse layer (only the saved --smoe-experts tells the layers apart). Resumed on one
    process the set is resharded into the model smlp-consolidate merges from it, bit for bit, and that file
    exports to a Hugging Face folder whose logits equal the checkpoint's (the export's own check, 1e-5)."""
    pytest.importorskip("transformers")
    from fairseq_plugins.checkpoints import consolidate, load_checkpoint
    from smlp_eval import hf_export

    smlp = ["--arch", "smlp_lm_tiny", "--num-experts", "4", "--smoe-experts", "2", "--disable-validation",
            "--max-update", "3"]
    args = [str(tiny_lm_data), "--user-dir", PLUGINS, *TINY_TRAIN, *smlp, "--save-dir", str(tmp_path / "ck")]
    text = assert_ok(run_fairseq("fairseq-train", [*args, "--smoe-parallel", "replicated"], world=2, timeout=600))
    assert "sMoE experts: replicated on every rank" in text and "(2 sMoE, 4 tMoE experts per sparse layer)" in text, \
        text[-3000:]
    shards = [load_checkpoint(str(tmp_path / "ck" / f"checkpoint_last-rank-{r}.pt")) for r in range(2)]
    smoe = [k for k in shards[0]["model"] if ".smoe.experts." in k]
    assert smoe and all(s["model"][k].shape[0] == 2 for s in shards for k in shards[0]["model"] if ".experts." in k)
    merged = load_checkpoint(consolidate(str(tmp_path / "ck" / "checkpoint_last.pt"), str(tmp_path / "merged.pt")))
    assert all(merged["model"][k].shape[0] == 2 for k in smoe)
    assert all(v.shape[0] == 4 for k, v in merged["model"].items() if ".tmoe.experts." in k)
    # resumed on one process: the resharded file (as fairseq-train installs it, before it trains on) is the merge
    from fairseq_plugins import elastic

    resharded, real = {}, elastic.reshard_checkpoint

    def keep(plan, rank, expert_params):
        real(plan, rank, expert_params)
        resharded["file"] = shutil.copy(plan.targets[0], tmp_path / "resharded.pt")

    monkeypatch.setattr(elastic, "reshard_checkpoint", keep)
    text = assert_ok(run_in_process("fairseq-train", [*args[:-1], str(tmp_path / "ck"), "--max-update", "4"]))
    assert "resharded checkpoint_last.pt (2 rank shards from a 2-rank run, 4 experts in groups of 2 (2 in each " \
           "sMoE)" in text, text[-3000:]
    assert sorted(train_losses(text)) == [4], text[-3000:]
    one = load_checkpoint(str(resharded["file"]))
    assert one["model"].keys() == merged["model"].keys()
    for k, v in merged["model"].items():
        assert torch.equal(one["model"][k], v), k
    result = hf_export.export(str(resharded["file"]), tmp_path / "hf", verify=True)
    assert result.max_logit_difference is not None and result.max_logit_difference <= 1e-5
