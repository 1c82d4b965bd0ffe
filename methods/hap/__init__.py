"""HAP's planner (hap, sfb) and the runtime of its programs; docs/planner.md and docs/hap-runtime.md.

What each module does, in the order a plan is made and run:

    theory          Hoare triples over sharding layouts per op (HAP Sec. 4.2)
    dtensor_rules   the triples DTensor's sharding strategies give, per ATen op
    steps           the step format: one triple per op, its collectives fused in
    pricing         what steps cost at fixed ratios, as bench.cost prices them
    bounds          the A* heuristic: a lower bound of what the undecided ops cost
    search          program synthesis by A* (HAP Sec. 4.3-4.5)
    segments        which ratio row (segment) each op follows (HAP Sec. 5.2)
    lowering        a synthesized program as the method-neutral bench Program
    balance         the ratios that minimise a Program's time, by LP (HAP Sec. 5)
    hierarchy       machine-level plans: data parallel inside each machine
    planner         the method: synthesis and LP iterated, levels, the plan
    collectives     collectives for uneven and empty shards, as autograd functions
    codegen         each rank's code of a plan: the captured graph on local shards
    runtime         training with a plan: the trainer a worker runs
    tensor_parallel tensor-parallel programs at three choices of ratios (Fig. 2)

Importing the package imports none of them: `methods.hap.planner` is what conf/method names.
"""
