"""Programs that measure one thing outside the run store, each `python -m smlp_bench.micro.NAME`:

    step_breakdown  where a training step of each family goes, per rank and block, its operators and host syncs
                    (the one profiler breakdown; `smlp-bench breakdown`)
    host_syncs      the host-sync counter it and tests/test_hot_path.py use
    generation      cached decoding against full recomputation (`smlp-bench-generation`)
    eval_routing    the balanced routers' evaluation routings on a checkpoint
"""
