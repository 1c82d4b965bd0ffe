"""What steps cost at fixed sharding ratios: their stages, memory and seconds, as bench.cost prices them.

The search (methods.hap.search) and the lowering to a Program (methods.hap.lowering) both read
these prices, so the program the search ranks is the program the simulator times. It does not
choose steps or ratios.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.core.cluster import ClusterSpec
from bench.core.program import (
    Affine,
    Collective,
    Stage,
    op_class,
)
from bench.cost import FloatAlgebra, collective_time, stage_time, virtual_devices
from methods.hap.segments import assign_segments
from methods.hap.steps import Step
from methods.hap.theory import IDENTITY, CommRule, Layout, Rule, Theory

ADAM_STATE_PER_PARAM = 2.0  # two fp32 moments per parameter


class CostModel:
    """Stage contents and seconds of steps at fixed ratios (cached per triple/collective)."""

    def __init__(self, theory: Theory, cluster: ClusterSpec, granularity: str, ratios: Sequence[Sequence[float]],
                 segmentation: str = "layers", grad_bucket_bytes: float = 0.0):
        self.theory = theory
        # > 0: replicated parameters' gradients are all-reduced in buckets of this many bytes
        # (build_program with grad_overlap), so each is charged its share of a full bucket's
        # all-reduce (source_time); 0: one all-reduce per parameter, as without overlap.
        self.grad_bucket_bytes = float(grad_bucket_bytes)
        self.graph = theory.graph
        self.cluster = cluster
        self.vdevs = virtual_devices(cluster, granularity)
        self.ratios = [list(r) for r in ratios]
        self.prices = FloatAlgebra(self.ratios)  # one for every price at these ratios
        self.num_segments = len(self.ratios)
        key = ("segments", self.num_segments, segmentation)
        if key not in theory.search_cache:  # the ratios do not move them: shared by every search
            theory.search_cache[key] = assign_segments(theory, self.num_segments, segmentation)
        self.op_segment, self.home = theory.search_cache[key]
        # The search's moves without their prices (_successors): they depend on the theory and
        # the segments alone, so every search of this theory at this segmentation shares them.
        self.segments_key = (self.num_segments, segmentation)
        self._recipes: dict = theory.search_cache.setdefault(("moves", self.segments_key), {})
        # op -> (tensors its moves depend on, their (tensor, layout) pairs)
        self._relevant: dict = theory.search_cache.setdefault(("relevant", self.num_segments), {})
        self.granularity = granularity
        self._rule_cost: dict = {}
        self._op_sig: dict = {}  # op -> what its triples' prices read besides the rule (rule_time)
        self._comm_cost: dict = {}  # CommRule -> seconds
        self._comm_price: dict = {}  # what a CommRule's price reads (comm_time) -> seconds
        self._coll_cost: dict = {}  # (kind, bytes, impl, devices, rows, grad) -> seconds
        self._param_cost: dict = {}
        self._moves: dict = {}  # search memo: (op, their layouts) -> moves, priced
        self._move_price: dict = {}  # what a move's price reads (_recipes) -> (seconds, its choices)

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
            return ([Collective("reshard", Affine(nbytes), label=c.tensor, rows=rows)],
                    [Collective("reshard", Affine(nbytes), label=f"d{c.tensor}", rows=rows[::-1])])
        shard = Affine.sharded(nbytes, home)
        dual = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}
        if c.kind == "all_reduce":
            fwd = Collective("all_reduce", Affine(nbytes), label=c.tensor)
            return [fwd], [fwd]
        if c.kind == "all_to_all":
            fwd = Collective("all_to_all", shard, label=c.tensor)
            return [fwd], [fwd]
        return [Collective(c.kind, shard, c.impl, label=c.tensor)], [Collective(dual[c.kind], shard, c.impl, label=c.tensor)]

    def rule_parts(self, step_node: str, rule: Rule) -> tuple[Affine, Affine, list[Collective]]:
        """(forward FLOPs, backward FLOPs, extra backward collectives for SFB) of a triple."""
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
                Collective("all_gather", Affine.sharded(float(self.graph[x].nbytes), seg), "padded", label=f"{x} (sfb)"),
                Collective("all_gather", Affine.sharded(float(node.nbytes), seg), "padded", label=f"d{node.name} (sfb)"),
            ]
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
        all-reduce of replicated parameters (build_program buckets and overlaps them)."""
        fwd_flops, bwd_flops, sfb = self.rule_parts(step.node, step.rule)
        fwd_c = [g for t, lay in step.sources if (g := self.input_gather(t, lay)) is not None]
        bwd_c: list[Collective] = []
        for c in step.comms:
            f, b = self.comm_collectives(c)
            fwd_c += f
            bwd_c += b
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
                f, b = self.comm_collectives(c)
                t = self._comm_price[key] = sum(self.collective_time(x) for x in f + b)
            self._comm_cost[c] = t
        return t

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
            sig = self._op_sig[node] = (self.op_segment[node], n.op, n.flops, n.backward_factor, n.nbytes, first,
                                        any(self.graph[t].is_param for t in n.inputs))
        return (*sig, rule.sharded, rule.sfb)

    def rule_time(self, node: str, rule: Rule) -> float:
        """Compute (fwd + bwd) plus SFB collectives of a triple, without parameter sync
        (cached by rule_key)."""
        key = self.rule_key(node, rule)
        if key not in self._rule_cost:
            fwd, bwd, extra = self.rule_parts(node, rule)
            kind_f, kind_b = self.compute_kind(node)
            self._rule_cost[key] = (self.stage_time(Stage((), fwd, **kind_f))
                                    + self.stage_time(Stage(tuple(extra), bwd, **kind_b)))
        return self._rule_cost[key]

    def compute_kind(self, name: str) -> tuple[dict, dict]:
        """Stage fields that say how an op's compute is priced, (forward, backward): its op
        class and the kernels it launches (backward: input and weight gradients of an op with
        parameters, one kernel otherwise; ops without FLOPs launch none)."""
        node = self.graph[name]
        cls = op_class(node.op)
        if not node.flops:
            return {"op_class": cls}, {"op_class": cls}
        has_params = any(self.graph[t].is_param for t in node.inputs)
        return {"op_class": cls, "launches": 1.0}, {"op_class": cls, "launches": 2.0 if has_params else 1.0}

    def input_gather(self, tensor: str, layout: Layout) -> Collective | None:
        """Each rank loads only its share of an input (batch dim 0); any other layout costs an
        all-gather of the input at run time (methods/hap/codegen.py does a padded one)."""
        node = self.graph[tensor]
        if node.kind != "placeholder" or layout == 0 or not node.shape or node.shape[0] <= 1:
            return None
        return Collective("all_gather", Affine.sharded(float(node.nbytes), 0), "padded",
                          label=f"{tensor} (input)")

    def source_key(self, tensor: str, layout: Layout, rule: Rule) -> tuple:
        """What the price of creating a source reads (source_time), as rule_key for triples."""
        node = self.graph[tensor]
        return (node.kind, node.shape, node.nbytes, node.is_param, self.home[tensor], layout, rule.sfb)

    def source_time(self, tensor: str, layout: Layout, rule: Rule) -> float:
        """Backward gradient sync of a parameter created in `layout` (plus the intra-machine
        all-reduce of its gradient when a device is a machine), or the all-gather of an input
        created in another layout than the one each rank loads."""
        key = self.source_key(tensor, layout, rule)
        if key not in self._param_cost:
            node = self.graph[tensor]
            t = 0.0
            gather = self.input_gather(tensor, layout)
            if gather is not None:
                t = collective_time(gather, self.cluster, self.vdevs, self.prices)
            if node.is_param:
                colls = []
                synced = layout == IDENTITY and not rule.sfb
                if synced and not self.grad_bucket_bytes:
                    colls.append(Collective("all_reduce", Affine(float(node.nbytes)), grad=True))
                st = Stage(tuple(colls), Affine(), grad_bytes=self._bytes(tensor, layout))
                t = self.stage_time(st)
                if synced and self.grad_bucket_bytes:
                    t += self.bucketed_sync_s(float(node.nbytes))
            self._param_cost[key] = t
        return self._param_cost[key]

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
        parallelism for fewer all-reduces (results/planner/20261128-data-parallel-incumbent.md)."""
        cap = self.grad_bucket_bytes
        if nbytes >= cap:
            return self.collective_time(Collective("all_reduce", Affine(nbytes), grad=True))
        return nbytes / cap * self.collective_time(Collective("all_reduce", Affine(cap), grad=True))
