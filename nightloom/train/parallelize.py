"""Apply a ParallelPlan to the model in a fixed order: pipeline split (even, or the plan's uneven `stages`) ->
TP (+SP) -> recompute -> FSDP2/HSDP over dp_shard (zero="fsdp"; "zero2" keeps parameters gathered from forward
to backward) or replicate over dp_replicate (plain data parallel: DDP semantics on FSDP2 machinery).

Follows torchtitan's parallelize_llama. Every rank builds only its pipeline stages on the meta device, applies
TP and FSDP/replicate there, and only then materialises its own shards and initialises them per parameter from
(seed, name), so layer names stay global, init is layout-free, and no rank ever holds a whole stage. A tied
embedding stays one parameter under TP and becomes two kept-identical copies under PP (train/tied.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from nightloom.parallel import LayoutError, ParallelDims, ParallelPlan
from nightloom.planner.memory import CE_CHUNK_TOKENS, chunked_ce
from nightloom.shape import ModelShape
from nightloom.train.lora import LoraSettings, apply_lora, init_lora
from nightloom.train.model import Transformer, build_model
from nightloom.train.moe import prepare_moe
from nightloom.train.offload import offloaded_layers
from nightloom.train.qlora import check_quantized_plan, init_quantized, quantize_base
from nightloom.train.sp_shard import save_shard
from nightloom.train.tied import LocalTiedCopies, TiedCopies, retie, tied_copies


@dataclass
class ModelParts:
    """The model chunks this rank holds (one unless interleaved PP) and, with PP, their schedule."""

    parts: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    schedule: object | None = None
    stages: list = field(default_factory=list)
    tied: TiedCopies | LocalTiedCopies | None = None  # a tied model's copy on the first or last pipeline stage
    loss: TokenLoss = field(default_factory=lambda: TokenLoss())  # the loss the pipeline schedule calls too

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


def validate_plan(
    shape: ModelShape, plan: ParallelPlan, seq_len: int, global_batch: int | None, world_size: int, device_type: str
) -> ParallelDims:
    """Every layout check that can run before a process group exists (ParallelDims.check, the rules the spec
    and the planner apply too); raises LayoutError naming the values."""
    if plan.world_size != world_size:
        raise LayoutError(
            f"plan {plan.layout()} needs tp({plan.tp})*pp({plan.pp})*dp_replicate({plan.dp_replicate})"
            f"*dp_shard({plan.dp_shard})*cp({plan.cp}) = {plan.world_size} processes, but WORLD_SIZE={world_size}"
        )
    dims = plan.dims()
    why = dims.check(shape, seq_len, global_batch, device_type=device_type)
    if why:
        raise LayoutError("; ".join(why))
    return dims


def _apply_tp(model: Transformer, tp_mesh, sp: bool, shard_saves: bool = False) -> None:
    """Megatron TP: attention/MLP column-then-row parallel; with SP the norms and residuals are sharded on T and,
    with `shard_saves`, the attention's and MLP's linears save their input's sequence shard (train/sp_shard.py)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sp else Replicate()
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        if sp:
            top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "ffn.w1": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(output_layouts=seq),
        }
        if block.ffn.w3 is not None:
            plan["ffn.w3"] = ColwiseParallel()
        if block.attn.q_norm is not None:  # qwen3: per-head norm of local heads (dim 2); weight replicated, grad summed
            plan |= {n: SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("attn.q_norm", "attn.k_norm")}
        if sp:
            plan.update(
                {
                    "attn_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attn": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                    ),
                    "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
            if block.attn_post_norm is not None:  # gemma3: norms after attention and MLP, on the sequence shard too
                plan |= {n: SequenceParallel(use_local_output=True) for n in ("attn_post_norm", "ffn_post_norm")}
        parallelize_module(block, tp_mesh, plan)
        if sp and shard_saves:
            save_shard(block.attn)
            save_shard(block.ffn)
    retie(model)  # a tied head takes the embedding's DTensor again (both vocab-sharded): one parameter


def _dp_mesh(dims: ParallelDims, mesh):
    """FSDP mesh: 1-D over dp_shard (x cp), or 2-D (dp_replicate, dp_shard x cp) for HSDP."""
    shard_names = ("dp_shard", "cp") if dims.cp > 1 else ("dp_shard",)
    if dims.cp > 1:
        mesh[shard_names]._flatten("dp_shard_cp")
        shard_names = ("dp_shard_cp",)
    if dims.dp_replicate > 1:
        return mesh[("dp_replicate", *shard_names)]
    return mesh[shard_names[0]]


def _replicate_mesh(dims: ParallelDims, mesh):
    """dp_shard == 1: one flattened mesh over every data-parallel dim (dp_replicate, cp)."""
    names = tuple(n for n in ("dp_replicate", "dp_shard", "cp") if getattr(dims, n) > 1)
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("dp_all")


def _apply_replicate(model: nn.Module, dp_mesh, param_dtype: torch.dtype | None) -> None:
    """DDP semantics (full replicas, all-reduced grads) on FSDP2's machinery, which composes with TP and PP."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy

    replicate(model, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))


def _apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype | None, keep_gathered: bool) -> None:
    """FSDP2 per block, then the root. `keep_gathered` (reshard_after_forward=False): parameters stay gathered
    from forward to backward: ZeRO-2-like (zero="zero2"), and always with PP (the schedule interleaves
    micro-batches; resharding after forward is also wrong with zero-bubble schedules on torch 2.13, see notes)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not keep_gathered)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not keep_gathered)


def compile_blocks(model: Transformer) -> None:
    """torch.compile each block's forward (torchtitan's per-block compile: one graph reused by every layer of the
    same shape). The module keeps its class and names (checkpoints unchanged); hooks FSDP2 adds later stay eager
    around it; LoRA's hooks and TP's hooks on the block's linears and norms are traced inside it. The block's input
    is resolved first (_waited_input): under TP the first block gets the embedding's async collective output."""
    for block in model.layers.values():
        block.forward = _waited_input(torch.compile(block.forward))


def _waited_input(compiled):
    """`compiled` called with its first argument waited on, in eager mode, when that is an AsyncCollectiveTensor.

    Under TP the embedding's RowwiseParallel ends in an async all-reduce (reduce-scatter with SP) and to_local(),
    so the first block receives an AsyncCollectiveTensor that requires grad. torch 2.13's AOTAutograd swaps such an
    input for its inner tensor before tracing (frontend_utils: `a.trigger_wait()`, which does not require grad), so
    the compiled graph returns no gradient for it: the embedding's Redistribute backward then gets zeros as a plain
    Tensor ("'Tensor' object has no attribute '_local_tensor'"). pytorch/pytorch#191113 restores the flag upstream.
    Waiting here with the functional wait_tensor (an identity in backward, no copy) hands the graph a plain tensor
    that keeps its autograd edge; the wait happens at the block's first op anyway."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor

    @functools.wraps(compiled)
    def forward(x, *args, **kwargs):
        if isinstance(x, AsyncCollectiveTensor):
            x = wait_tensor(x)
        return compiled(x, *args, **kwargs)

    return forward


def check_compile(plan: ParallelPlan) -> None:
    """train.compile runs with DP/FSDP2/replicate, PP and TP with or without SP (tested); under TP with recompute
    (full or selective) torch 2.13 fails at the first compiled step, so that pair is refused naming the fields
    rather than left to crash at step 1.

    Why: TP's compiled block saves the DeviceMesh of its DTensor parameters for backward (an opaque object,
    expected last among the forward's saved outputs); recomputing attention makes the partitioner's
    functionalize_rng_ops append the RNG state of the recomputed SDPA (tagged nondeterministic_seeded) after it, so
    the runtime's slices shift and it stops on "expected all tensors_saved_with_vc_check to be Tensors ...
    DeviceMesh". Without TP nothing opaque is saved; without recompute nothing is appended."""
    if plan.tp > 1 and plan.recompute != "none":
        raise ValueError(
            f"train.compile: true with parallel.tp {plan.tp} and parallel.recompute {plan.recompute!r} (layout "
            f"{plan.layout()}) is not supported: torch 2.13 fails on the compiled blocks' recomputed attention "
            "under TP; use recompute 'none' with TP, compile: false, or tp = 1"
        )


FP8_DIM_MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) need both dims of a weight to be multiples of 16


def check_fp8(plan: ParallelPlan, device_type: str, lora: bool) -> None:
    """train.precision fp8 runs on a GPU with DP/FSDP2 (tp = pp = 1 tested); else ValueError naming the field."""
    if device_type != "cuda":
        raise ValueError(
            f"train.precision: fp8 needs a CUDA GPU with float8 tensor cores (H100/H200 class); this rank runs on "
            f"{device_type}: use bf16 or fp32 there"
        )
    if plan.tp > 1 or plan.pp > 1 or lora:
        raise ValueError(
            f"train.precision: fp8 runs with data parallel / FSDP2 only (layout {plan.layout()}"
            f"{', train.lora set' if lora else ''}): float8 TP plans and fp8 LoRA are not wired; use bf16"
        )


def convert_fp8(model: Transformer, recipe: str) -> int:
    """Swap the blocks' linears for torchao Float8Linear (on the meta device, before FSDP2); the head and the
    embedding stay bf16 (as torchtitan). Tensorwise scaling all-gathers float8 weights under FSDP2. Returns how
    many linears were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    seen: list[str] = []

    def keep(mod: nn.Module, fqn: str) -> bool:
        ok = (
            isinstance(mod, nn.Linear)
            and fqn.startswith("layers.")
            and mod.in_features % FP8_DIM_MULTIPLE == 0
            and mod.out_features % FP8_DIM_MULTIPLE == 0
        )
        if ok:
            seen.append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return len(seen)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


IGNORE_INDEX = -100  # a target that is not a label (train/data.py's, F.cross_entropy's default)


def label_nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token NLL (fp32) over the targets that are labels (not IGNORE_INDEX)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class TokenLoss:
    """The loss of one micro-batch, as the trainer and the pipeline schedule call it.

    `scale` None (pretraining): the mean cross entropy of the micro-batch. A number (train.task sft, and any eval
    under PP): the sum of NLL over label targets times `scale`. For sft the trainer sets scale = dp·cp·m / N before
    each step, N the label tokens of the whole global batch (all ranks, all m micro-batches): FSDP averages
    gradients over the dp·cp ranks and the step divides each micro-batch's loss by m (the schedule: scale_grads),
    which leaves the gradient of sum(NLL) / N, the single-process mean over the same batch's label tokens."""

    def __init__(self):
        self.scale: float | None = None
        #: (vocab, softcap, chunk tokens) when the loss is fused with the head, chunk by chunk (train/loss.py)
        self.chunked: tuple[int, float | None, int] | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return loss_fn(logits, targets)
        return label_nll_sum(logits, targets) * self.scale

    def of(self, model: nn.Module, x: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None):
        """The micro-batch's loss through `model` (pp = 1): the chunked loss fused with the head when `chunked`,
        else the whole logits then this loss."""
        kw = {} if doc_ids is None else {"doc_ids": doc_ids}
        if self.chunked is None:
            return self(model(x, **kw), targets)
        from nightloom.train.loss import HeadLoss

        vocab, softcap, chunk = self.chunked
        return model(x, head_loss=HeadLoss(targets, vocab, softcap, self.scale, chunk), **kw)


def build_parts(
    shape: ModelShape,
    plan: ParallelPlan,
    dims: ParallelDims,
    mesh,
    seq_len: int,
    seed: int,
    device: torch.device,
    param_dtype: torch.dtype | None,
    lora: LoraSettings | None = None,
    compile: bool = False,
    fp8: str | None = None,
    loss_chunk: int = CE_CHUNK_TOKENS,
    sp_save_shard: bool = True,
) -> ModelParts:
    """This rank's model chunks, parallelised; with pp > 1 also the pipeline schedule. With `lora` the base is
    frozen and the targeted linears get adapters (train/lora.py), split as their base under TP. `compile`:
    torch.compile per block (after TP and LoRA, before FSDP2); `fp8` (a torchao recipe, GPU): float8 linears;
    `loss_chunk` tokens per chunk of the loss fused with the head where the head is whole (0: plain loss);
    `sp_save_shard` False keeps torch's TP saving the all-gathered linear inputs under SP (to measure the change)."""
    if fp8 is not None:
        check_fp8(plan, device.type, lora is not None)
    if compile:
        check_compile(plan)
    v = dims.chunks_per_rank
    n_stages = plan.pp * v
    pp_rank = mesh["pp"].get_local_rank() if mesh is not None else 0
    stage_ids = dims.rank_chunks(pp_rank)
    bounds = dims.stage_bounds(shape.layers)  # layers of every stage (uneven when the plan says so)
    parts: list[nn.Module] = []
    for s in stage_ids:
        m = build_model(shape, seq_len, device="meta")
        if n_stages > 1:
            m.keep_layers(*bounds[s], has_embed=s == 0, has_head=s == n_stages - 1)
        # shard while still on the meta device, then materialise only this rank's shards and initialise them
        if plan.tp > 1:
            # the gathered input saved as its shard (not under compile; full recompute saves only the block input)
            shard_saves = sp_save_shard and not compile and plan.recompute != "full"
            _apply_tp(m, mesh["tp"], plan.sp, shard_saves=shard_saves)
        if fp8 is not None:
            convert_fp8(m, fp8)
        if lora is not None and lora.quant is not None:  # QLoRA: the base's linears stored quantized
            check_quantized_plan(plan)
            quantize_base(m, lora.quant)
        if lora is not None:
            apply_lora(m, lora, mesh["tp"] if plan.tp > 1 else None, plan.sp)
        m.set_recompute(plan.recompute)
        if plan.offload_layers:  # this rank's first layers keep their activations in host memory (train/offload.py)
            mine = [i for t in stage_ids for i in range(*bounds[t])]
            m.set_offload(offloaded_layers(mine, plan.offload_layers) & set(range(*bounds[s])), device)
        if compile:
            compile_blocks(m)
        if shape.moe:  # mixture of experts (train/moe.py): unsupported layouts refused; EP before FSDP2
            prepare_moe(m, shape, dims, device.type, param_dtype)
        if dims.dp * dims.cp > 1:  # cp ranks hold the same parameters: their gradients are reduced too
            if dims.dp_shard == 1:
                _apply_replicate(m, _replicate_mesh(dims, mesh), param_dtype)
            else:
                _apply_fsdp(m, _dp_mesh(dims, mesh), param_dtype, keep_gathered=plan.pp > 1 or dims.zero == "zero2")
        m.to_empty(device=device)
        m.init_weights(seed)
        if lora is not None:
            init_lora(m, seed)
            if lora.quant is not None:
                init_quantized(m, seed)
        parts.append(m)
    out = ModelParts(parts, stage_ids, n_stages)
    if loss_chunk and chunked_ce(plan.pp, plan.tp, plan.cp):  # the head is whole here: fused with the loss
        out.loss.chunked = (shape.vocab, shape.final_logit_softcap, loss_chunk)
    if mesh is not None:
        out.tied = tied_copies(shape, parts, stage_ids, n_stages, mesh, v_shape=plan.schedule == "zbv")
        if out.tied is not None:
            out.tied.sync_weights()  # the last stage's copy starts as the first's
    if plan.pp > 1:
        _pipeline(out, plan, mesh, device)
    return out


def _pipeline(out: ModelParts, plan: ParallelPlan, mesh, device: torch.device) -> None:
    """The pipeline stages of this rank's chunks (train/pipeline_stage.LeanStage) and the plan's schedule."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    from nightloom.train.pipeline_stage import LeanStage

    group = mesh["pp"].get_group()  # receive buffers per micro-batch in flight, not m per chunk for the run
    each = plan.reduce_each_micro_batch  # FSDP2 reduce-scatters every micro-batch (planner/grad_sync.py)
    out.stages = [
        LeanStage(m, s, out.n_stages, device, group=group, reduce_each_micro_batch=each)
        for m, s in zip(out.parts, out.stage_ids)
    ]
    if plan.schedule == "interleaved_1f1b":
        out.schedule = ScheduleInterleaved1F1B(out.stages, n_microbatches=plan.grad_accum, loss_fn=out.loss)
    elif plan.schedule == "zbv":  # V-shaped zero bubble: backward split into input and weight passes
        out.schedule = ScheduleZBVZeroBubble(out.stages, n_microbatches=plan.grad_accum, loss_fn=out.loss)
    else:
        cls = Schedule1F1B if plan.schedule == "1f1b" else ScheduleGPipe
        out.schedule = cls(out.stages[0], n_microbatches=plan.grad_accum, loss_fn=out.loss)
