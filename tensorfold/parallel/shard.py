"""What a rank keeps of each weight, and the block classes that keep heads.

ShardReader is a WeightReader whose `linear()` gives this rank's part of a GEMM:
- by default its share of the output rows (N split in contiguous ranges, across the parts of a
  fused weight as if they were one matrix), wrapped in a ShardedLinear that gathers the outputs,
  so the caller sees the whole [M, N] and needs to know nothing;
- where a sharded block asked for it (`planned`): the rows of its own heads or intermediate
  columns with no gather (`Rows`), or a weight whose input arrives sharded (`GatheredInput`: the
  input is gathered whole, then the output rows are split as above).

ShardedAttention, ShardedMLP and ShardedGatedDeltaNet are the base blocks on a local spec (the
rank's heads, its intermediate columns): their cache keeps only their heads' K/V or recurrent
state, and their forward is the base one. ShardedMoE keeps whole experts, a share of them per
rank. Every other block (a family's own attention or MoE) is
built unchanged on the reader and gets the default: its GEMMs split and gathered, its other
work and state replicated on every rank. The LM head keeps the rank's vocabulary rows
(`vocab_head`); the runner draws from them with the shard exchange.
"""
from dataclasses import dataclass, replace

import torch

from tensorfold.parallel.group import RankGroup, split_sizes
from tensorfold.kernels.quant_gemm import take_rows
from tensorfold.models.blocks import MLP, Attention
from tensorfold.models.cache import RecurrentState
from tensorfold.models.linear_attention import GatedDeltaNet, LinearAttentionSpec, input_matrices, read_params
from tensorfold.models.moe import MoE, MoESpec, experts_one
from tensorfold.models.gguf_quants import FileBlocks, StoredColumns
from tensorfold.models.spec import AttentionSpec, MLPSpec
from tensorfold.models.weights import WeightReader


@dataclass(frozen=True)
class Rows:
    """Keep rows [start, stop) of the named matrix (and its bias), computed with no gather."""
    start: int
    stop: int


@dataclass(frozen=True)
class GatheredInput:
    """The matrix's input arrives split by rank into `widths` columns: gather it first."""
    widths: tuple[int, ...]


class ShardedLinear:
    """A rank's rows of a GEMM weight (`local`, the op set's LinearWeight) that gives the whole
    output: x (gathered first where the input is split) times the local rows, then every rank's
    outputs side by side. Each output is its own dot product over the whole K, computed as one
    rank computes it, so the gathered [M, N] is the one-rank result bit for bit."""

    def __init__(self, local, group: RankGroup, out_widths: list[int], in_widths: tuple[int, ...] | None = None):
        self.local, self.group, self.out_widths, self.in_widths = local, group, out_widths, in_widths
        self.formats, self.bias, self.parts = local.formats, local.bias, local.parts
        self.widths = tuple(out_widths)
        self.in_features = in_widths[group.rank] if in_widths else local.in_features

    single = None  # never one packed part: a native fused layer would skip the gathers

    @property
    def format(self) -> str:
        return self.local.format

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(self.out_widths), self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_widths is not None:
            x = self.group.gather_columns(x, list(self.in_widths))
        return self.group.gather_columns(self.local(x), self.out_widths)


class ShardReader(WeightReader):
    def __init__(self, tensors: dict, dtype, device, ops, group: RankGroup, prefix: str = "",
                 norm_offset: float = 0.0, plan: dict | None = None):
        super().__init__(tensors, dtype, device, ops, prefix, norm_offset)
        self.group, self.plan = group, plan or {}

    def under(self, prefix: str) -> "ShardReader":
        return ShardReader(self.tensors, self.dtype, self.device, self.ops, self.group, self.prefix + prefix,
                           self.norm_offset, self.plan)

    def planned(self, plan: dict) -> "ShardReader":
        """This reader with per-matrix rules (full names -> Rows or GatheredInput)."""
        return ShardReader(self.tensors, self.dtype, self.device, self.ops, self.group, self.prefix,
                           self.norm_offset, {**self.plan, **{self.prefix + k: v for k, v in plan.items()}})

    def linear(self, *names: str, biases: tuple[str, ...] = ()):
        full = [self.prefix + n for n in names]
        rules = {type(self.plan.get(n)) for n in full}
        if rules == {Rows}:
            ranges = [(self.plan[n].start, self.plan[n].stop) for n in full]
            return self.ops.Linear.of(*(self._rows(n, a, b) for n, (a, b) in zip(names, ranges)),
                                      bias=self._bias(biases, ranges))
        if len(rules) != 1 or rules - {GatheredInput, type(None)}:
            raise ValueError(f"shard plan for {full}: one rule for all parts of a fused weight")
        in_widths = self.plan[full[0]].widths if rules == {GatheredInput} else None
        heights = [self._height(n) for n in names]
        if sum(heights) < self.group.size:  # too narrow to split (a one-output gate): every rank keeps it
            return super().linear(*names, biases=biases)
        sizes = split_sizes(sum(heights), self.group.size)
        start = sum(sizes[:self.group.rank])
        stop = start + sizes[self.group.rank]
        kept, first = [], 0  # (name, bias name, rows): the rank's rows of each part, the parts as one matrix
        for i, (name, h) in enumerate(zip(names, heights)):
            a, b = min(max(start - first, 0), h), min(max(stop - first, 0), h)
            if b > a:
                kept.append((name, biases[i] if biases else None, (a, b)))
            first += h
        bias = self._bias(tuple(b for _, b, _ in kept), [r for _, _, r in kept]) if biases else None
        local = self.ops.Linear.of(*(self._rows(n, a, b) for n, _, (a, b) in kept), bias=bias)
        return ShardedLinear(local, self.group, sizes, in_widths)

    def vocab_head(self, matrix, packed=None):
        """The LM head's rows of this rank's vocabulary range (vocab_range), with no gather: the
        draw exchanges instead."""
        start, stop = vocab_range(matrix.shape[0], self.group)
        return self.ops.Linear.of(_take_rows(matrix, start, stop))

    def _height(self, name: str) -> int:
        return self.tensors[self.prefix + name].shape[0] if self.has(name) else self.matrix(name).shape[0]

    def _rows(self, name: str, start: int, stop: int):
        full = self.prefix + name
        stored = self.tensors.get(full)
        if isinstance(stored, FileBlocks):  # read only these rows from the file
            return WeightReader({full: stored.rows(slice(start, stop))}, self.dtype, self.device, self.ops).matrix(full)
        return _take_rows(self.matrix(name), start, stop)

    def _bias(self, biases: tuple[str, ...], ranges: list[tuple[int, int]]):
        parts = [self.maybe(b) for b in biases]
        if not parts or any(p is None for p in parts):
            return None
        return torch.cat([p[a:b] for p, (a, b) in zip(parts, ranges)]).contiguous()


def _take_rows(matrix, start: int, stop: int):
    """Rows [start, stop) of a checkpoint matrix (a tensor or QuantWeight), as their own copy
    (blocks still in the file: those rows of it, read when packed)."""
    if isinstance(matrix, StoredColumns):  # rows keep the file's column order
        return matrix.map(lambda stored: _take_rows(stored, start, stop))
    if isinstance(matrix, FileBlocks):
        return matrix.rows(slice(start, stop))
    return _copy(matrix[start:stop] if isinstance(matrix, torch.Tensor) else matrix.rows(slice(start, stop)))


def vocab_range(vocab: int, group: RankGroup) -> tuple[int, int]:
    """The token ids [start, stop) whose logits this rank computes."""
    sizes = split_sizes(vocab, group.size)
    start = sum(sizes[:group.rank])
    return start, start + sizes[group.rank]


def _head_range(count: int, group: RankGroup) -> tuple[int, int]:
    per = count // group.size
    return group.rank * per, (group.rank + 1) * per


class ShardedAttention(Attention):
    """Attention over this rank's heads: its Q/K/V rows, its KV heads' cache; o_proj gathers
    the heads' outputs first."""

    def __init__(self, spec: AttentionSpec, w: ShardReader, ctx):
        n = w.group.size
        q0, q1 = _head_range(spec.num_heads, w.group)
        k0, k1 = _head_range(spec.num_kv_heads, w.group)
        q_rows = spec.head_dim * (2 if spec.output_gate else 1)  # Qwen3.5: [q, gate] per head
        d = spec.head_dim
        plan = {"self_attn.q_proj.weight": Rows(q0 * q_rows, q1 * q_rows),
                "self_attn.k_proj.weight": Rows(k0 * d, k1 * d), "self_attn.v_proj.weight": Rows(k0 * d, k1 * d),
                "self_attn.o_proj.weight": GatheredInput((spec.num_heads // n * d,) * n)}
        local = replace(spec, num_heads=spec.num_heads // n, num_kv_heads=spec.num_kv_heads // n)
        super().__init__(local, w.planned(plan), ctx)


class ShardedMLP(MLP):
    """A gated MLP over this rank's intermediate columns; down gathers them first."""

    def __init__(self, spec: MLPSpec, w: ShardReader, ctx):
        sizes = split_sizes(spec.intermediate_size, w.group.size)
        start = sum(sizes[:w.group.rank])
        stop = start + sizes[w.group.rank]
        plan = {"mlp.gate_proj.weight": Rows(start, stop), "mlp.up_proj.weight": Rows(start, stop),
                "mlp.down_proj.weight": GatheredInput(tuple(sizes))}
        super().__init__(replace(spec, intermediate_size=stop - start), w.planned(plan), ctx)


class ShardedGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet over this rank's heads: its key heads and the value heads they serve (each
    head's conv channels, delta rule and state are its own), their rows of the input projection,
    their part of the recurrent state; out_proj gathers the value heads' outputs first. A spec
    whose key heads do not divide stays whole (the default split)."""

    def __init__(self, spec: LinearAttentionSpec, w: ShardReader, ctx):
        n, r = w.group.size, w.group.rank
        la = w.under("linear_attn.")
        hk, h, dk, dv = spec.num_key_heads // n, spec.num_heads // n, spec.key_dim, spec.value_dim
        local = replace(spec, num_key_heads=hk, num_heads=h)
        # this rank's rows of [q, k, v, z, b, a] (the projection's plain order), and of the conv's [q, k, v]
        starts = [0, spec.num_key_heads * dk]
        starts += [2 * starts[1], 2 * starts[1] + spec.num_heads * dv]
        starts += [starts[3] + spec.num_heads * dv, starts[3] + spec.num_heads * dv + spec.num_heads]
        widths = [hk * dk, hk * dk, h * dv, h * dv, h, h]
        keep = torch.cat([torch.arange(start + r * width, start + (r + 1) * width)
                          for start, width in zip(starts, widths)])
        full = read_params(spec, la)
        heads = slice(r * h, (r + 1) * h)
        self.spec, self.ops, self.eps = local, w.ops, ctx.norm_eps
        self.in_proj = w.ops.Linear.of(*_rows_of_parts(input_matrices(spec, la), keep))
        self.out_proj = la.planned({"out_proj.weight": GatheredInput((h * dv,) * n)}).linear("out_proj.weight")
        conv_keep = keep[keep < spec.conv_dim]
        self.params = replace(full, num_key_heads=hk, num_heads=h, conv_weight=full.conv_weight[conv_keep].contiguous(),
                              rate=full.rate[heads].contiguous(), dt_bias=full.dt_bias[heads].contiguous())
        self.norm = la.dense("norm.weight")  # per value_dim: every head's
        self.cache_spec = RecurrentState(local.conv_dim, local.conv_kernel, h, dk, dv)


def _rows_of_parts(parts: list, keep: torch.Tensor) -> list:
    """Rows `keep` (indices into the parts stacked along N) of each part, as their own copies."""
    out, first = [], 0
    for part in parts:
        mine = keep[(keep >= first) & (keep < first + part.shape[0])] - first
        if mine.numel():
            out.append(_copy(take_rows(part, mine)))
        first += part.shape[0]
    return out


def _copy(matrix):
    if isinstance(matrix, torch.Tensor):
        return matrix.clone()
    return type(matrix)(matrix.kind, *(None if t is None else t.clone() for t in
                                       (matrix.codes, matrix.scale, matrix.scale_exp, matrix.min, matrix.min_exp)))


class ShardedMoE(MoE):
    """Experts split among the ranks, each kept whole by one rank (expert parallel): a rank runs
    its experts over the rows that chose them, every rank's weighted outputs are gathered in one
    collective per layer, and each row adds its terms in ascending expert index as one rank
    does, so the sum is the one-rank sum bit for bit. The router and the shared expert take the
    default split."""
    fusable = False

    def __init__(self, spec: MoESpec, w: ShardReader, ctx):
        self.group = w.group
        sizes = split_sizes(spec.num_experts, w.group.size)
        self.owner = torch.repeat_interleave(torch.arange(w.group.size), torch.tensor(sizes))  # expert -> rank
        super().__init__(spec, w, ctx)

    def read_experts(self, spec: MoESpec, mlp: ShardReader) -> list:
        whole = WeightReader(mlp.tensors, mlp.dtype, mlp.device, mlp.ops, mlp.prefix, mlp.norm_offset)
        mine = set((self.owner == self.group.rank).nonzero().flatten().tolist())
        return [experts_one(spec, whole, e) if e in mine else None for e in range(spec.num_experts)]

    def routed(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows_n, k, hidden = x.shape[0], chosen.shape[1], x.shape[1]
        terms = torch.zeros(rows_n, k, hidden, dtype=torch.float32, device=x.device)  # this rank's experts' terms
        for e in torch.unique(chosen).tolist():
            if self.experts[e] is not None:
                rows, slot = torch.nonzero(chosen == e, as_tuple=True)
                terms[rows, slot] = self.experts[e](x[rows]).float() * weights[rows, slot, None]
        n = self.group.size
        every = self.group.gather_columns(terms.reshape(rows_n, k * hidden), [k * hidden] * n)
        every = every.reshape(rows_n, n, k, hidden)
        index = torch.arange(rows_n, device=x.device)[:, None]
        owned = every[index, self.owner.to(x.device)[chosen], torch.arange(k, device=x.device)[None, :]]  # [rows, k, H]
        order = chosen.argsort(dim=1)  # each row's slots in ascending expert index
        out = torch.zeros(rows_n, hidden, dtype=torch.float32, device=x.device)
        for j in range(k):
            out += owned[index[:, 0], order[:, j]]
        return out


def sharded_blocks(blocks: dict, group: RankGroup, args) -> dict:
    """A family's block classes with the base attention, MLP and Gated DeltaNet keeping their
    heads (where their heads divide among the ranks); a family's own classes keep the default."""
    out = dict(blocks)
    if blocks.get(AttentionSpec) is Attention:
        out[AttentionSpec] = ShardedAttention
    if blocks.get(MLPSpec) is MLP:
        out[MLPSpec] = ShardedMLP
    if blocks.get(MoESpec) is MoE:
        out[MoESpec] = ShardedMoE
    if blocks.get(LinearAttentionSpec) is GatedDeltaNet and int(args.hf.get("linear_num_key_heads") or 0) % group.size == 0:
        out[LinearAttentionSpec] = ShardedGatedDeltaNet
    return out
