"""The one profiler breakdown: where a training step of each family goes, per rank and per block, with its operators
(op_count.py) and host syncs (host_syncs.py): `smlp-bench breakdown` (`python -m smlp_bench.micro.step_breakdown`)."""
