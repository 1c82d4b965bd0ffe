"""What steps cost at fixed sharding ratios: their stages, memory and seconds, as bench.cost prices them.

The search (methods.hap.search) and the lowering to a Program (methods.hap.lowering) both read
these prices, so the program the search ranks is the program the simulator times. A step's
price is the map of its forward stage and the map of its backward stage followed by its
parameters' gradient syncs on the timeline bench.cost.price.iteration_time walks (lanes for
compute, the network and the all-reduce inside machines): a complete program's price is the
simulator's time, overlap, optimizer step and per-step terms included (program_cost), but for
one approximation: each gradient's sync is its bytes' share of a full bucket's all-reduce,
launched once its own gradient is made, where the runtime launches a bucket once its last one
is (exact with one bucket per parameter, method.bucket_cap_mb=0). With gradient accumulation
(k micro-steps, the steps one micro-step's) the price is the iteration's over k: one
micro-step, with each gradient sync and the optimizer step and per-step terms of the iteration
charged 1/k, as the program pays them once in k micro-steps: exact where the syncs wait in
their backward stages (no overlap) and the host does not bound the lanes. With syncs beside
backward the program makes them all beside the last micro-step's backward, so the price is
(k - 1) / k of a micro-step that syncs nothing and 1 / k of one that syncs every gradient
(CostModel.pair), each on its own timeline where the simulator runs the micro-steps on one
(docs/planner.md, "Search"). It does not choose steps or ratios.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from bench.core.cluster import ClusterSpec
from bench.core.program import Affine, Collective, Memory, Program, Stage, op_class
from bench.cost import FloatAlgebra, collective_time, stage_time, virtual_devices
from bench.cost.lanes import ZERO_LANES, apply, compose, end, prepend, stage_map
from bench.cost.price import busiest_gpu_ratios, intra_grad_sync, launch_times, stage_parts, step_terms
from methods.hap.segments import assign_segments
from methods.hap.steps import Step
from methods.hap.theory import IDENTITY, CommRule, Layout, Rule, Theory

ADAM_STATE_PER_PARAM = 2.0  # two fp32 moments per parameter


class CostModel:
    """Stage contents and seconds of steps at fixed ratios (cached per triple/collective)."""

    def __init__(
        self,
        theory: Theory,
        cluster: ClusterSpec,
        granularity: str,
        ratios: Sequence[Sequence[float]],
        segmentation: str = "layers",
        grad_bucket_bytes: float = 0.0,
        grad_overlap: bool = False,
        micro_steps: int = 1,
        once: float | None = None,
    ):
        self.theory = theory
        # Gradient accumulation: the steps are one of micro_steps micro-steps; what the
        # iteration pays once (gradient syncs, optimizer step, per-step terms) is charged 1/k
        # (`once`: that share on one timeline, not the `pair`; 0.0 prices a micro-step that
        # syncs nothing).
        self.micro_steps = int(micro_steps)
        self._once = 1.0 / self.micro_steps if once is None else float(once)
        self._paired = once is None and self.micro_steps > 1 and bool(grad_overlap)
        self._segmentation = segmentation
        self._pair: tuple | None = None
        # grad_overlap: replicated parameters' gradients are all-reduced beside the rest of
        # backward (build_program with grad_overlap), in buckets of grad_bucket_bytes (0: one
        # per parameter), each charged its share of a full bucket's all-reduce (sync_map).
        # Off: each all-reduce is in its op's backward stage, whose compute waits for it.
        self.grad_bucket_bytes = float(grad_bucket_bytes)
        self.grad_overlap = bool(grad_overlap)
        self.graph = theory.graph
        self.cluster = cluster
        self.vdevs = virtual_devices(cluster, granularity)
        self.ratios = [list(r) for r in ratios]
        # One for every price at these ratios; a machine computes at its busiest GPU's samples,
        # as the simulator prices it (bench.cost.price.busiest_gpu_ratios).
        self.prices = FloatAlgebra(self.ratios, busiest_gpu_ratios(self.ratios, self.vdevs, self.graph.batch_size))
        self.machines = granularity == "machine" and any(v.num_gpus > 1 for v in self.vdevs)
        self.num_segments = len(self.ratios)
        key = ("segments", self.num_segments, segmentation)
        if key not in theory.search_cache:  # the ratios do not move them: shared by every search
            theory.search_cache[key] = assign_segments(theory, self.num_segments, segmentation)
        self.op_segment, self.home = theory.search_cache[key]
        # The search's moves without their prices (_successors): they depend on the theory and
        # the segments alone, so every search of this theory at this segmentation shares them.
        self.segments_key = (self.num_segments, segmentation)
        self._recipes: dict = theory.search_cache.setdefault(("moves", self.segments_key), {})
        # the same key -> per recipe, the layouts it adds and the tensors it communicates that
        # live on past its op (the search's states keep only those)
        self._live: dict = theory.search_cache.setdefault(("live", self.segments_key), {})
        # what a move's price reads (_recipes) -> a number naming it, so that a price is looked
        # up by the number (the moves of every search of this theory name them alike)
        self._price_ids: dict = theory.search_cache.setdefault(("price ids", self.segments_key), {})
        # op -> (tensors its moves depend on, their (tensor, layout) pairs)
        self._relevant: dict = theory.search_cache.setdefault(("relevant", self.num_segments), {})
        self.granularity = granularity
        self._rule_cost: dict = {}
        # op -> what its triples' prices read besides the rule (rule_time), and op -> how its
        # compute is priced (compute_kind): the ratios do not move them
        self._op_sig: dict = theory.search_cache.setdefault(("op signatures", self.segments_key), {})
        self._kinds: dict = theory.search_cache.setdefault(("compute kinds",), {})
        self._comm_cost: dict = {}  # CommRule -> seconds
        self._comm_price: dict = {}  # what a CommRule's price reads (comm_time) -> seconds
        self._coll_cost: dict = {}  # (kind, bytes, impl, devices, rows, grad) -> seconds
        self._param_cost: dict = {}
        self._moves: dict = {}  # search memo: (op, their layouts) -> moves, priced
        self._search_moves: dict = {}  # the same key -> per recipe (its Step, its price) as synthesize reads them
        self._move_price: dict = {}  # what a move's price reads (its _price_ids number) -> (its maps, its choices, its search form)
        self._rule_parts_s: dict = {}  # rule_key -> (forward compute, SFB collectives, backward compute)
        self._comm_parts: dict = {}  # comm_key -> (forward seconds, backward seconds)
        self._sync_maps: dict = {}  # source_key -> the map of its gradient's sync (overlap)
        self._program_costs: dict = {}  # (steps, final collectives) -> program_cost: the planner asks again
        self._goal: tuple | None = None  # (the lower bound of the step terms, kernels per op class)

    # -- stage contents ----------------------------------------------------------------------
    def _bytes(self, tensor: str, layout: Layout, segment: int | None = None) -> Affine:
        """Bytes of `tensor` per device in `layout` (Gather: by its home segment's row)."""
        nbytes = float(self.graph[tensor].nbytes)
        seg = self.home[tensor] if segment is None else segment
        return Affine.sharded(nbytes, seg) if isinstance(layout, int) else Affine(nbytes)

    def needs_reshard(self, tensor: str, layout: Layout, segment: int) -> bool:
        """Whether an op in `segment` reads `tensor` in `layout` from another row's shards."""
        if not isinstance(layout, int) or self.home[tensor] == segment:
            return False
        shape = self.graph[tensor].shape
        return bool(shape) and int(shape[layout]) > 1

    def reshard(self, tensor: str, layout: Layout, segment: int) -> CommRule:
        return CommRule(tensor, layout, layout, "reshard", to_segment=segment)

    def comm_collectives(self, c: CommRule) -> tuple[list[Collective], list[Collective]]:
        """(forward, backward) collectives of one re-layout; backward runs the dual."""
        if c.free:
            return [], []
        nbytes = float(self.graph[c.tensor].nbytes)
        home = self.home[c.tensor]
        if c.kind == "reshard":
            rows = (home, c.to_segment)
            return (
                [Collective("reshard", Affine(nbytes), label=c.tensor, rows=rows)],
                [Collective("reshard", Affine(nbytes), label=f"d{c.tensor}", rows=rows[::-1])],
            )
        shard = Affine.sharded(nbytes, home)
        dual = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}
        if c.kind == "all_reduce":
            fwd = Collective("all_reduce", Affine(nbytes), label=c.tensor)
            return [fwd], [fwd]
        if c.kind == "all_to_all":
            fwd = Collective("all_to_all", shard, label=c.tensor)
            return [fwd], [fwd]
        return [Collective(c.kind, shard, c.impl, label=c.tensor)], [
            Collective(dual[c.kind], shard, c.impl, label=c.tensor)
        ]

    def rule_parts(self, step_node: str, rule: Rule) -> tuple[Affine, Affine, list[Collective]]:
        """(forward FLOPs, backward FLOPs, extra backward collectives for SFB) of a triple; an
        op an activation checkpoint recomputes runs its forward again in backward."""
        node = self.graph[step_node]
        seg = self.op_segment[step_node]
        f = node.flops
        fwd = Affine.sharded(f, seg) if rule.sharded else Affine(f)
        bwd = fwd.scale(node.backward_factor)
        extra: list[Collective] = []
        if rule.sfb:
            # Gather the sufficient factors (input and output gradient), then every device
            # computes the full weight gradient: half the backward work, unsharded.
            bwd = Affine.sharded(f * node.backward_factor / 2, seg) + Affine(f * node.backward_factor / 2)
            x = node.inputs[0]
            extra = [
                Collective(
                    "all_gather", Affine.sharded(float(self.graph[x].nbytes), seg), "padded", label=f"{x} (sfb)"
                ),
                Collective(
                    "all_gather", Affine.sharded(float(node.nbytes), seg), "padded", label=f"d{node.name} (sfb)"
                ),
            ]
        if step_node in self.graph.recomputed:
            bwd = bwd + fwd
        return fwd, bwd, extra

    def param_sync(self, step: Step) -> list[Collective]:
        """Gradient all-reduce of replicated parameters created at this step (none with SFB)."""
        out = []
        for t, layout in step.sources:
            if self.graph[t].is_param and layout == IDENTITY and not step.rule.sfb:
                out.append(Collective("all_reduce", Affine(float(self.graph[t].nbytes)), label=f"grad {t}", grad=True))
        return out

    def grad_bytes(self, step: Step) -> Affine:
        total = Affine()
        for t, layout in step.sources:
            if self.graph[t].is_param:
                total = total + self._bytes(t, layout)
        return total

    def stages(self, step: Step, param_sync: bool = True) -> tuple[Stage, Stage]:
        """(forward, backward) stage of a step; param_sync=False leaves out the gradient
        all-reduce of replicated parameters (build_program buckets and overlaps them). A step
        an activation checkpoint recomputes issues its forward collectives again in backward
        (the recompute runs the step as forward did: its FLOPs are rule_parts')."""
        fwd_flops, bwd_flops, sfb = self.rule_parts(step.node, step.rule)
        fwd_c = [g for t, lay in step.sources if (g := self.input_gather(t, lay)) is not None]
        bwd_c: list[Collective] = []
        for c in step.comms:
            f, b = self.comm_collectives(c)
            fwd_c += f
            bwd_c += b
        if step.node in self.graph.recomputed:
            bwd_c = fwd_c + bwd_c
        bwd_c += sfb + (self.param_sync(step) if param_sync else [])
        label = step.describe()
        kind_f, kind_b = self.compute_kind(step.node)
        return (
            Stage(tuple(fwd_c), fwd_flops, label=f"fwd {label}", **kind_f),
            Stage(tuple(bwd_c), bwd_flops, grad_bytes=self.grad_bytes(step), label=f"bwd {label}", **kind_b),
        )

    # -- seconds -----------------------------------------------------------------------------
    def stage_time(self, st: Stage) -> float:
        """The stage alone: its collectives, then its slowest device's compute. The all-reduce
        of its gradients inside machine-level devices is not charged: it runs on the intra-machine
        link beside the rest of backward (bench.cost.price), which only the simulator can price."""
        return stage_time(st, self.cluster, self.vdevs, self.prices)

    def comm_key(self, c: CommRule) -> tuple:
        """What the price of a re-layout reads (comm_collectives): a deep model's layers share it."""
        return (c.kind, c.impl, c.to_segment, self.graph[c.tensor].nbytes, self.home[c.tensor])

    def comm_time(self, c: CommRule) -> float:
        t = self._comm_cost.get(c)
        if t is None:
            key = self.comm_key(c)
            t = self._comm_price.get(key)
            if t is None:
                t = self._comm_price[key] = sum(self.comm_seconds(c))
            self._comm_cost[c] = t
        return t

    def comm_seconds(self, c: CommRule) -> tuple[float, float]:
        """(forward, backward) seconds of a re-layout: its collectives and their duals."""
        key = self.comm_key(c)
        parts = self._comm_parts.get(key)
        if parts is None:
            f, b = self.comm_collectives(c)
            parts = self._comm_parts[key] = (
                sum(self.collective_time(x) for x in f),
                sum(self.collective_time(x) for x in b),
            )
        return parts

    def collective_time(self, x: Collective) -> float:
        """Seconds of one collective at this model's ratios, priced once per distinct call
        (tensors of one size, as in a model's repeated layers, share it: the label is not priced)."""
        key = (x.kind, x.nbytes, x.impl, x.devices, x.rows, x.grad)
        t = self._coll_cost.get(key)
        if t is None:
            t = self._coll_cost[key] = collective_time(x, self.cluster, self.vdevs, self.prices)
        return t

    def rule_key(self, node: str, rule: Rule) -> tuple:
        """What the price of a triple reads (rule_parts, compute_kind), not the op's name: the
        repeated layers of a deep model share one per segment."""
        sig = self._op_sig.get(node)
        if sig is None:  # once per op: the search asks for its triples' prices again and again
            n = self.graph[node]
            first = self.graph[n.inputs[0]].nbytes if n.inputs else 0
            sig = self._op_sig[node] = (
                self.op_segment[node],
                n.op,
                n.flops,
                n.backward_factor,
                n.nbytes,
                first,
                any(self.graph[t].is_param for t in n.inputs),
                node in self.graph.recomputed,
            )
        return (*sig, rule.sharded, rule.sfb)

    def rule_time(self, node: str, rule: Rule) -> float:
        """Compute (fwd + bwd) plus SFB collectives of a triple, without parameter sync
        (cached by rule_key): what it adds to the compute lane."""
        key = self.rule_key(node, rule)
        if key not in self._rule_cost:
            self._rule_cost[key] = sum(self.rule_seconds(node, rule))
        return self._rule_cost[key]

    def rule_seconds(self, node: str, rule: Rule) -> tuple[float, float, float]:
        """(forward compute, SFB collectives, backward compute) of a triple (cached by rule_key)."""
        key = self.rule_key(node, rule)
        parts = self._rule_parts_s.get(key)
        if parts is None:
            fwd, bwd, extra = self.rule_parts(node, rule)
            kind_f, kind_b = self.compute_kind(node)
            comm, comp_b = stage_parts(Stage(tuple(extra), bwd, **kind_b), self.cluster, self.vdevs, self.prices)
            _, comp_f = stage_parts(Stage((), fwd, **kind_f), self.cluster, self.vdevs, self.prices)
            parts = self._rule_parts_s[key] = (comp_f, comm, comp_b)
        return parts

    def compute_kind(self, name: str) -> tuple[dict, dict]:
        """Stage fields that say how an op's compute is priced, (forward, backward): its op
        class and the kernels it launches (backward: input and weight gradients of an op with
        parameters, one kernel otherwise, and its forward's again where an activation checkpoint
        recomputes it; ops without FLOPs launch none)."""
        kinds = self._kinds.get(name)
        if kinds is None:  # once per op and theory (callers read the dicts, never change them)
            node = self.graph[name]
            cls = op_class(node.op)
            if not node.flops:
                kinds = {"op_class": cls}, {"op_class": cls}
            else:
                has_params = any(self.graph[t].is_param for t in node.inputs)
                again = 1.0 if name in self.graph.recomputed else 0.0
                kinds = (
                    {"op_class": cls, "launches": 1.0},
                    {"op_class": cls, "launches": (2.0 if has_params else 1.0) + again},
                )
            self._kinds[name] = kinds
        return kinds

    def input_gather(self, tensor: str, layout: Layout) -> Collective | None:
        """Each rank loads only its share of an input (batch dim 0); any other layout costs an
        all-gather of the input at run time (methods/hap/codegen.py does a padded one)."""
        node = self.graph[tensor]
        if node.kind != "placeholder" or layout == 0 or not node.shape or node.shape[0] <= 1:
            return None
        return Collective("all_gather", Affine.sharded(float(node.nbytes), 0), "padded", label=f"{tensor} (input)")

    def source_key(self, tensor: str, layout: Layout, rule: Rule) -> tuple:
        """What the price of creating a source reads (source_time), as rule_key for triples."""
        node = self.graph[tensor]
        return (node.kind, node.shape, node.nbytes, node.is_param, self.home[tensor], layout, rule.sfb)

    def source_time(self, tensor: str, layout: Layout, rule: Rule) -> float:
        """What creating a source adds to the compute lane: the all-gather of an input created
        in another layout than the one each rank loads (in forward), and without overlap the
        all-reduce of a replicated parameter's gradient (in its op's backward stage). With
        overlap that all-reduce, and the one inside machines, run beside backward (sync_map)."""
        key = self.source_key(tensor, layout, rule)
        if key not in self._param_cost:
            t = self.gather_time(tensor, layout)
            if self.graph[tensor].is_param and not self.grad_overlap and layout == IDENTITY and not rule.sfb:
                grad = Collective("all_reduce", Affine(float(self.graph[tensor].nbytes)), grad=True)
                t += self.collective_time(grad) * self._once
            self._param_cost[key] = t
        return self._param_cost[key]

    def gather_time(self, tensor: str, layout: Layout) -> float:
        """Seconds of the all-gather of an input created in another layout than each rank loads."""
        gather = self.input_gather(tensor, layout)
        return 0.0 if gather is None else collective_time(gather, self.cluster, self.vdevs, self.prices)

    def sync_map(self, tensor: str, layout: Layout, rule: Rule) -> tuple | None:
        """With overlap, the map of a parameter's gradient sync once backward has made it: the
        all-reduce among the devices of a replicated one (its bytes' share of a full bucket's,
        bucketed_sync_s) on the network beside the rest of backward, and over machines of
        several GPUs every gradient's all-reduce inside the machine (its share of a bucket's
        latency) on that lane; as methods.hap.lowering buckets them. None: nothing to sync."""
        key = self.source_key(tensor, layout, rule)
        if key in self._sync_maps:
            return self._sync_maps[key]
        m = None
        node = self.graph[tensor]
        across = layout == IDENTITY and not rule.sfb
        if node.is_param and (across or self.machines):
            local = self._bytes(tensor, layout)
            size = (
                float(node.nbytes)
                if not self.machines
                else max(local.at(self.ratios, d) for d in range(len(self.vdevs)))
            )
            comm = self.bucketed_sync_s(size) * self._once if across else 0.0
            sync = 0.0
            if self.machines:
                share = min(1.0, size / self.grad_bucket_bytes) if self.grad_bucket_bytes else 1.0
                sync = intra_grad_sync(Stage((), grad_bytes=local), self.cluster, self.vdevs, self.prices, share)
                sync *= self._once
            if comm or sync:
                m = stage_map(comm, 0.0, across, True, sync)
        self._sync_maps[key] = m
        return m

    def backward_sync(self, sources: Sequence[tuple[str, Layout]]) -> float:
        """Without overlap, over machines: the all-reduce inside the machines of the gradients a
        step's backward makes (of the parameters among its `sources`), on that lane."""
        if self.grad_overlap or not self.machines:
            return 0.0
        nbytes = Affine()
        for t, layout in sources:
            if self.graph[t].is_param:
                nbytes = nbytes + self._bytes(t, layout)
        return intra_grad_sync(Stage((), grad_bytes=nbytes), self.cluster, self.vdevs, self.prices) * self._once

    def step_maps(
        self, name: str, rule: Rule, sources: Sequence[tuple[str, Layout]], fwd_comm: float, bwd_comm: float
    ) -> tuple[float, float, tuple, float | None]:
        """(seconds of a step's forward collectives, of its forward compute, the map of its
        backward stage followed by the syncs of the gradients of the parameters among its
        `sources`, and that backward's compute when the map is the compute lane's alone) for
        a step of op `name` running `rule` whose collectives take `fwd_comm` and `bwd_comm`
        (its triple's SFB collectives aside)."""
        comp_f, sfb, comp_b = self.rule_seconds(name, rule)
        comm = bwd_comm + sfb
        m = stage_map(comm, comp_b, comm > 0.0, False, self.backward_sync(sources))
        if self.grad_overlap:
            for t, layout in reversed(sources):  # in the order backward hands them to the buckets
                sync = self.sync_map(t, layout, rule) if self.graph[t].is_param else None
                if sync is not None:
                    m = compose(sync, m)
        return fwd_comm, comp_f, m, (comp_b if m == stage_map(0.0, comp_b, False, False) else None)

    def goal(self) -> tuple[float, float, Counter]:
        """(the host's seconds to queue every program's forward and backward kernels; a lower
        bound of what a complete program adds after: the optimizer step and the per-step
        terms with no parameter held; the kernels per op class every program of this graph
        launches)."""
        if self._goal is None:
            launches = self.theory.search_cache.get(("launches",))
            if launches is None:  # the same at any ratios
                launches = Counter()
                for name in self.theory.rules:
                    for kind in self.compute_kind(name):
                        launches[kind["op_class"]] += kind.get("launches", 0.0)
                self.theory.search_cache[("launches",)] = launches
            empty = Program(
                (), len(self.vdevs), self.num_segments, self.granularity, Memory(), micro_steps=self.micro_steps
            )
            host = launch_times(launches, self.vdevs)[0]
            after = step_terms(empty, self.cluster, self.vdevs, self.prices, 0.0, Counter(), self._once)
            self._goal = (host, after, launches)
        return self._goal

    def complete(self, lanes_end: float, steps: Sequence[Step]) -> float:
        """A complete program's price from where its lanes end: the host's queueing, the
        optimizer step and the per-step terms at the parameter bytes its devices hold, as
        bench.cost.price.iteration_time ends an iteration (over k micro-steps: those terms of
        the iteration's, 1/k of them after this micro-step's lanes)."""
        params = Affine()
        for step in steps:
            for t, layout in step.sources:
                if self.graph[t].is_param:
                    params = params + self._bytes(t, layout)
        program = Program(
            (),
            len(self.vdevs),
            self.num_segments,
            self.granularity,
            Memory(params=params),
            batch=self.graph.batch_size,
            micro_steps=self.micro_steps,
        )
        return step_terms(program, self.cluster, self.vdevs, self.prices, lanes_end, self.goal()[2], self._once)

    @property
    def pair(self) -> tuple[CostModel, CostModel] | None:
        """Under gradient accumulation with overlapped syncs, the two micro-steps an iteration
        is made of: k - 1 that sync nothing (`once` 0) and the last, which syncs every gradient
        beside its backward and pays the optimizer step and the per-step terms (as one step
        does); the search prices the iteration over k as (k - 1) / k of the first's price and
        1 / k of the second's. One timeline with each sync at 1/k would spread the syncs over
        every micro-step's backward, where the program has them all in the last (docs/planner.md,
        "Search"). None otherwise: one timeline is exact."""
        if not self._paired:
            return None
        if self._pair is None:
            args = (
                self.theory,
                self.cluster,
                self.granularity,
                self.ratios,
                self._segmentation,
                self.grad_bucket_bytes,
            )
            self._pair = (
                CostModel(*args, self.grad_overlap, self.micro_steps, once=0.0),
                CostModel(*args, self.grad_overlap, 1),
            )
        return self._pair

    def program_cost(self, steps: Sequence[Step], final_comms: Sequence[CommRule] = ()) -> float:
        """What the search charges a complete program at these ratios (synthesize's cost_s):
        its forward stages then its backward stages (each with its gradients' syncs) on the
        lanes, the loss's last collective, then the optimizer step and the per-step terms; with
        a `pair`, its two micro-steps' prices weighted as the iteration has them."""
        key = (tuple(steps), tuple(final_comms))
        price = self._program_costs.get(key)
        if price is None:
            if self.pair is not None:
                quiet, last = self.pair
                k = self.micro_steps
                price = (k - 1) / k * quiet.program_cost(steps, final_comms) + last.program_cost(steps, final_comms) / k
            else:
                price = self._program_cost(steps, final_comms)
            self._program_costs[key] = price
        return price

    def _program_cost(self, steps: Sequence[Step], final_comms: Sequence[CommRule]) -> float:
        lanes, row = ZERO_LANES, ZERO_LANES
        for step in steps:
            q, p, m, _ = self.step_maps(step.node, step.rule, step.sources, *self.step_comms(step))
            lanes = apply(stage_map(q, p, q > 0.0, False), lanes)
            row = prepend(row, m)
        final = sum(self.comm_time(c) for c in final_comms)
        return self.complete(end(row, lanes) + final, steps)

    def step_comms(self, step: Step) -> tuple[float, float]:
        """(forward seconds of a step's collectives: its sources' gathers and its re-layouts;
        their backward seconds, and without overlap the all-reduces of the gradients of the
        replicated parameters it creates)."""
        node = self.graph[step.node]
        read = set(node.inputs) | {t for t, _ in step.rule.shape_pre}  # a source only for its shape is free
        fwd = bwd = 0.0
        for t, layout in step.sources:
            if t in read:
                gather = self.gather_time(t, layout)
                fwd, bwd = fwd + gather, bwd + self.source_time(t, layout, step.rule) - gather
        for c in step.comms:
            f, b = self.comm_seconds(c)
            fwd, bwd = fwd + f, bwd + b
        return fwd, bwd

    def bucketed_sync_s(self, nbytes: float) -> float:
        """Seconds charged for all-reducing a replicated parameter's `nbytes` of gradient that
        rides in a bucket of grad_bucket_bytes with others: its bytes' share of a full bucket's
        all-reduce, the call's latency (and the host transport's floor) shared out by bytes; a
        gradient that fills a bucket alone pays its own all-reduce.

        Summed over a bucket's gradients this is within one call's latency (or floor) of the
        bucket's all-reduce, where a price is affine in the bytes: a full bucket, which passes
        its cap by less than its last gradient (bucket_runs), is charged a little more, the last
        and partial one less. One all-reduce per parameter, each paying the latency, would price
        what the runtime runs plus that latency per parameter, and the search would trade data
        parallelism for fewer all-reduces (docs/planner.md, "Search")."""
        cap = self.grad_bucket_bytes
        if nbytes >= cap:
            return self.collective_time(Collective("all_reduce", Affine(nbytes), grad=True))
        return nbytes / cap * self.collective_time(Collective("all_reduce", Affine(cap), grad=True))
