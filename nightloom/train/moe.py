"""Mixture-of-experts feed-forward (qwen3_moe, mixtral, deepseek_v3) and expert parallelism.

The router is a linear layer (hidden -> experts); each token goes to its top-k experts by softmax probability,
weighted by those probabilities (renormalised to sum to 1 when `norm_topk_prob`: mixtral always). The experts are
stacked weights (E, ffn, hidden) / (E, hidden, ffn), so FSDP2 and expert parallelism shard dim 0. Computation is
grouped: rows sorted by expert, one SwiGLU per expert over its rows (a loop; on GPU `torch._grouped_mm` when torch
has it). Dropless: every token reaches its k experts, no capacity factor and nothing overflows.

Expert parallelism (`parallel.ep`, EP drawn from the dp_shard ranks as torchtitan does): experts are a DTensor
sharded on dim 0 over the EP group's ranks; rows travel to the rank owning their expert and back with
torch's autograd all_to_all_single (functional collectives; uneven splits). The experts are then FSDP2-sharded
on dim 1 over the dp_shard / ep ranks that hold the same experts (one rank each under EP = dp_shard). Router,
attention and norms stay under FSDP2 over all of dp_shard as in a dense model.

Router statistics of the last forward (top-k assignments and summed probabilities per expert) stay on each MoE
layer; `router_aux_loss` combines them into transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6,
counts and probabilities pooled over the MoE layers, times the number of experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nightloom.shape import ModelShape
from nightloom.train.recompute import recomputed


@dataclass
class RouterStats:
    """One MoE layer's routing in one forward: top-k assignments per expert (no gradient), the routers'
    probabilities summed over the tokens (with gradient: the aux loss trains the router), the token count."""

    counts: torch.Tensor  # (E,) float32
    prob_sum: torch.Tensor  # (E,) float32
    tokens: int


class _GradScale(torch.autograd.Function):
    """Identity forward, gradient times `scale` backward (expert gradients under EP: see `apply_expert_parallel`)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _grouped_mm_available(x: torch.Tensor) -> bool:
    """torch._grouped_mm (GPU, bf16) for the experts' matmuls; CPU keeps the loop."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


GROUP_ALIGN = 16  # rows per expert group padded to a multiple of this for torch._grouped_mm (as torchtitan)


def _grouped_swiglu(x: torch.Tensor, counts: list[int], w1, w3, w2) -> torch.Tensor:
    """The experts' SwiGLU as three grouped GEMMs (GPU): each expert's rows padded with zero rows to GROUP_ALIGN,
    the padding dropped after."""
    padded = [-(-n // GROUP_ALIGN) * GROUP_ALIGN for n in counts]
    dst = [sum(padded[:e]) for e in range(len(counts))]
    idx = torch.cat([torch.arange(d, d + n, device=x.device) for d, n in zip(dst, counts)])
    xp = x.new_zeros(sum(padded), x.shape[1]).index_copy(0, idx, x)
    offs = torch.tensor(padded, device=x.device).cumsum(0).to(torch.int32)
    gate = torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(xp, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)[idx]


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w1 gate (E, ffn, hidden), w3 up (E, ffn, hidden), w2 down
    (E, hidden, ffn). Under EP each rank holds its E/ep experts (a DTensor sharded on dim 0)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.grad_scale = 1.0

    def local_weights(self) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out = []
        for w in (self.w1, self.w3, self.w2):
            if isinstance(w, DTensor):
                w = w.to_local()  # this rank's experts (FSDP has gathered its own dim already)
            if self.grad_scale != 1.0:
                w = _GradScale.apply(w, self.grad_scale)
            out.append(w)
        return out

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (M, hidden): rows grouped by local expert, `counts[e]` rows for expert e -> (M, hidden)."""
        w1, w3, w2 = (w.to(x.dtype) for w in self.local_weights())  # rows and weights in one dtype
        if _grouped_mm_available(x) and x.shape[0]:
            return _grouped_swiglu(x, counts, w1, w3, w2)
        outs, start = [], 0
        for e, n in enumerate(counts):  # empty groups too: every local weight gets a (zero) gradient
            xe = x[start : start + n]
            start += n
            g, u = F.linear(xe, w1[e]), F.linear(xe, w3[e])
            # saved for backward: g and u, silu(g) recomputed (as the dense FeedForward does)
            outs.append(F.linear(recomputed(_swiglu, g, u), w2[e]))
        return torch.cat(outs)


def _swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


class SharedExperts(nn.Module):
    """DeepSeek's always-active experts: one SwiGLU of shared_experts · expert_ffn_hidden (transformers'
    DeepseekV3MLP at moe_intermediate_size · n_shared_experts), on every token beside the routed ones."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(recomputed(_swiglu, self.w1(x), self.w3(x)))


class MoEFeedForward(nn.Module):
    """Router + grouped experts in place of the dense MLP (transformers' Qwen3MoeSparseMoeBlock /
    MixtralSparseMoeBlock math; mixtral's router_jitter_noise is not applied). With `router_score` "sigmoid"
    (DeepSeek-V3, transformers' DeepseekV3TopkRouter and DeepseekV3MoE): fp32 sigmoid scores; experts chosen by
    score + `router_bias` (a buffer: DeepSeek's auxiliary-loss-free balancing, loaded and exported, not trained
    here) among the router_topk_groups groups whose two best such scores sum highest; their weights the plain
    scores, renormalised when norm_topk_prob, times routed_scaling; plus the shared experts on every token."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = shape.num_experts, shape.experts_per_token, shape.norm_topk_prob
        self.sigmoid = shape.router_score == "sigmoid"
        self.groups, self.topk_groups, self.scaling = (
            shape.router_groups,
            shape.router_topk_groups,
            shape.routed_scaling,
        )
        self.router = nn.Linear(shape.hidden, shape.num_experts, bias=False)
        if self.sigmoid:
            self.register_buffer("router_bias", torch.zeros(shape.num_experts))
        self.experts = GroupedExperts(shape.num_experts, shape.hidden, shape.expert_ffn_hidden)
        ffn = shape.shared_experts * shape.expert_ffn_hidden
        self.shared = SharedExperts(shape.hidden, ffn) if shape.shared_experts else None
        self.ep_group = None  # expert parallel: the process group the experts are split over
        self.ep_size = 1
        self.stats: RouterStats | None = None

    def _route(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k weights (rows, k), expert indices (rows, k), per-expert probabilities (rows, E) for the stats)."""
        if not self.sigmoid:
            probs = F.softmax(self.router(xf), dim=-1, dtype=torch.float32)
            top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            return top_w, top_i, probs
        # fp32 as transformers' router; recomputed in backward so the fp32 copy of the rows is not kept
        scores = recomputed(self._sigmoid_scores, xf)
        choice = scores + self.router_bias
        if self.groups > 1:  # keep the topk_groups groups whose two best choice scores sum highest
            grouped = choice.view(-1, self.groups, self.num_experts // self.groups)
            best = grouped.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_groups, dim=-1)[1], 1.0).bool()
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)
        top_i = torch.topk(choice, self.top_k, dim=-1)[1]
        top_w = scores.gather(1, top_i)
        if self.norm_topk:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * self.scaling, top_i, scores

    def _sigmoid_scores(self, xf: torch.Tensor) -> torch.Tensor:
        return F.linear(xf.float(), self.router.weight.float()).sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        xf = x.reshape(-1, h)
        top_w, top_i, probs = self._route(xf)
        top_w = top_w.to(x.dtype)
        flat = top_i.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.stats = RouterStats(counts.detach().float(), probs.sum(dim=0), xf.shape[0])
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token = order // self.top_k
        rows = xf[token]
        if self.ep_group is None:
            y = self.experts(rows, counts.tolist())
        else:
            y = self._dispatch(rows, counts)
        # back to (token, slot) order, then the weighted sum over a token's k slots: saves y once for backward
        # (an index_add into zeros would keep the weighted copy as well)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y[inverse].view(-1, self.top_k, h)
        out = (y * top_w.unsqueeze(-1)).sum(dim=1).view(b, t, h)
        return out if self.shared is None else out + self.shared(x)

    def _dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each row to the EP rank owning its expert, compute there, bring the results back (same order)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd as all_to_all

        ep, local = self.ep_size, self.num_experts // self.ep_size
        send = counts.view(ep, local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)  # counts: [source rank, local expert]
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = all_to_all(rows, out_splits, in_splits, self.ep_group)
        # rows arrive by source rank, each source's rows by expert: regroup by local expert
        expert = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep), recv.reshape(-1))
        order = torch.argsort(expert, stable=True)
        y = self.experts(got[order], recv.sum(0).tolist())
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all(y[inverse], in_splits, out_splits, self.ep_group)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def router_aux_loss(model: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(transformers' load-balancing loss over the last forward's MoE layers, the top-k assignments per expert
    summed over those layers); (None, None) for a dense model. Unscaled: the trainer multiplies by the coefficient."""
    stats = [m.stats for m in moe_layers(model) if m.stats is not None]
    if not stats:
        return None, None
    rows = float(sum(s.tokens for s in stats))
    counts = torch.stack([s.counts for s in stats]).sum(0)
    probs = torch.stack([s.prob_sum for s in stats]).sum(0)
    return len(counts) * torch.sum((counts / rows) * (probs / rows)), counts


def apply_expert_parallel(model: nn.Module, dims, device_type: str, param_dtype: torch.dtype | None = None) -> None:
    """EP on a meta-device model (before FSDP): every MoE layer's experts become a DTensor sharded on dim 0 over
    an EP group of consecutive dp_shard ranks, then FSDP2 over the dp_shard / ep ranks with the same experts
    (dim 1; a one-rank mesh under plain EP), so the dense FSDP of the block leaves them alone.

    Gradients: a rank's experts see rows from every EP rank, so their gradient is the sum of those ranks' local
    losses' gradients, and FSDP averages it over dp_shard / ep ranks; the step needs the mean over all dp_shard
    ranks, hence the 1/ep gradient scale on the expert weights (identity forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    ep, rest = dims.ep, dims.dp_shard // dims.ep
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)  # as the dense blocks'
    root = init_device_mesh(device_type, (rest, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    ep_mesh = root["ep"]
    for ffn in moe_layers(model):
        ex = ffn.experts
        for name in ("w1", "w3", "w2"):
            p = getattr(ex, name)
            dt = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(ex, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        fully_shard(ex, mesh=root["dp_mod_ep"], shard_placement_fn=lambda _p: Shard(1), mp_policy=mp)
        ex.grad_scale = 1.0 / ep
        ffn.ep_group, ffn.ep_size = ep_mesh.get_group(), ep


class ExpertLoad:
    """One step's router bookkeeping for the trainer: the aux-loss term of each micro-batch (coefficient times
    transformers' load-balancing loss, as its ForCausalLM adds it with output_router_logits), and the top-k
    assignments per expert summed over MoE layers and micro-batches (all ranks: `take`), so an imbalanced router
    shows in metrics.jsonl, Prometheus and the plots."""

    def __init__(self, coef: float, num_experts: int):
        self.coef = coef
        self.counts = torch.zeros(num_experts, dtype=torch.float64)
        self.aux = 0.0
        self.micro = 0

    def loss(self, model: nn.Module) -> torch.Tensor | float:
        """The aux-loss term of the forward `model` just ran (0 when the coefficient is 0)."""
        aux, counts = router_aux_loss(model)
        if aux is None:
            return 0.0
        self.counts += counts.detach().double().cpu()
        self.aux += float(aux.detach())
        self.micro += 1
        return self.coef * aux if self.coef else 0.0

    def take(self, device: torch.device) -> tuple[list[int], float]:
        """(tokens routed to each expert this step over every rank, summed over MoE layers; the mean unscaled aux
        loss over ranks and micro-batches); collective over the world, then reset."""
        t = torch.cat([self.counts, torch.tensor([self.aux, float(self.micro)], dtype=torch.float64)]).to(device)
        if dist.is_initialized():
            dist.all_reduce(t)
        self.counts.zero_()
        self.aux, self.micro = 0.0, 0
        n = len(t) - 2
        return [int(round(v)) for v in t[:n].tolist()], float(t[n] / max(float(t[n + 1]), 1.0))


def imbalance(counts: list[int]) -> float | None:
    """max / mean tokens per expert (1.0 = perfectly balanced; E / k when every token picks the same experts)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else None


def prepare_moe(
    model: nn.Module, shape: ModelShape, dims, device_type: str, param_dtype: torch.dtype | None = None
) -> None:
    """Before FSDP2, on the meta device: refuse what the trainer does not run for MoE (LayoutError naming the
    degrees), then expert parallelism when ep > 1."""
    from nightloom.parallel import LayoutError

    why = dims.moe_trainer_errors(shape)
    if why:
        raise LayoutError("; ".join(why))
    if dims.ep > 1:
        apply_expert_parallel(model, dims, device_type, param_dtype)
