"""The one-question micro-benchmarks: each `python -m smlp_bench.micro.NAME` measures one thing and
writes one JSON record (its module docstring says what), on the skeleton of `harness.py`.

    balanced_assignment  our auction against fairseq's C++ libbase, and its quality against the optimum
    causal_product       the blocked causal product against the masked dense form
    compile_dense        torch.compile of a dense block against eager on the CPU
    local_experts        several experts on one process: one product against a loop
    hot_path             host syncs (counted by host_syncs.py) and torch.compile graph breaks per step
    sparse_profile       torch.profiler of one sparse layer's step on 2 gloo ranks
    step_breakdown       where a whole training step of each family goes, per rank, and its operators
    memory_growth        resident memory of each rank against updates in a long run
    generation           cached decoding against full recomputation (`smlp-bench-generation`)
    eval_routing         the balanced routers' evaluation routings on a checkpoint: perplexity, loads, rerouted tokens
"""
