"""The decoder's forward with a KV cache, over the native model's own modules (train/model.py): the same norms,
projections, RoPE tables and MLPs as training, so generation samples from exactly the policy that trains.

Rows are left-padded: row b's tokens sit in the cache's last slots, `pad[b]` empty slots before them, so a new
token's slot is the same for every row and its RoPE position is its slot minus `pad[b]` (transformers' position ids
from the attention mask's cumulative sum). A query sees the keys at or before its slot that are not padding, and on
a sliding-window layer only the last `window` of those (transformers' sliding mask). Without sequence parallelism a
tensor-parallel model runs as is: each rank projects its own heads and the row-parallel output projection sums them.
DeepSeek's latent attention has no cached path here (refused)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nightloom.train.model import Transformer, apply_rope


@dataclass
class KVCache:
    """Per layer K and V (B, kv_heads_local, max_len, head_dim), filled up to `length` slots; `pad` (B,) empty
    slots at the start of each row."""

    pad: torch.Tensor
    max_len: int
    length: int = 0
    keys: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def append(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, heads, t, d) after the filled slots; return every filled slot's K and V so far."""
        if layer not in self.keys:
            b, h, _, d = k.shape
            self.keys[layer] = k.new_zeros(b, h, self.max_len, d)
            self.values[layer] = v.new_zeros(b, h, self.max_len, d)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} slots, asked for {end}")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def check_cacheable(model: Transformer) -> None:
    """Refuse, by name, a model whose forward this module cannot reproduce with a cache."""
    if model.shape.mla:
        raise NotImplementedError("native rollouts: DeepSeek latent attention (MLA) has no cached path yet")
    if model.tok_embeddings is None or model.output is None or len(model.layers) != model.shape.layers:
        raise NotImplementedError("native rollouts need the whole model on a rank (no pipeline stages)")
    mesh = getattr(model.norm.weight, "device_mesh", None)  # (after FSDP2's gather) only sequence parallel's
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):  # norms are distributed over the tp mesh
        raise NotImplementedError("native rollouts: sequence parallelism (sp) is not supported; run with sp off")


def _attention_mask(cache: KVCache, t: int, window: int | None) -> torch.Tensor:
    """(B, 1, t, length+t) boolean: the t new queries (slots length..length+t-1) see non-pad keys at or before
    their slot, within `window` when given."""
    end = cache.length + t
    q = torch.arange(cache.length, end, device=cache.pad.device)[:, None]
    k = torch.arange(end, device=cache.pad.device)[None, :]
    allowed = (k <= q)[None] & (k[None] >= cache.pad[:, None, None])
    if window is not None:
        allowed = allowed & ((q - k) < window)[None]
    return allowed[:, None]


def _attend(attn, x: torch.Tensor, cos, sin, cache: KVCache, layer: str, mask: torch.Tensor) -> torch.Tensor:
    """One Attention module's forward for new tokens x (B, t, hidden), their K/V appended to the cache."""
    b, t, _ = x.shape
    q = attn.wq(x).view(b, t, -1, attn.head_dim)
    k = attn.wk(x).view(b, t, -1, attn.head_dim)
    v = attn.wv(x).view(b, t, -1, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = cache.append(layer, k.transpose(1, 2), v.transpose(1, 2))
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=attn.scale, enable_gqa=attn.rep > 1
    )
    return attn.wo(o.transpose(1, 2).reshape(b, t, -1))


def _block(block, h: torch.Tensor, cos, sin, cache: KVCache, layer: str, mask: torch.Tensor) -> torch.Tensor:
    """Block._forward with the cached attention."""
    return block.after_attention(h, _attend(block.attn, block.attn_norm(h), cos, sin, cache, layer, mask))


def _rope_at(model: Transformer, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s RoPE tables gathered at positions (B, t): (B, t, rope_dim/2)."""
    s = model.shape
    local = s.rope_local_theta is not None and s.is_sliding(layer)
    cos, sin = (model.rope_local_cos, model.rope_local_sin) if local else (model.rope_cos, model.rope_sin)
    if int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"position {int(positions.max())} is past the model's RoPE tables ({cos.shape[0]})")
    return cos[positions], sin[positions]


def cached_logits(model: Transformer, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, vocab) of the last of the new tokens `ids` (B, t), which fill the cache's next t slots."""
    s = model.shape
    t = ids.shape[1]
    slots = torch.arange(cache.length, cache.length + t, device=ids.device)
    positions = (slots[None, :] - cache.pad[:, None]).clamp(min=0)
    h = model.tok_embeddings(ids)
    if s.embed_scale:  # Gemma: sqrt(hidden) rounded to the embedding dtype first, as the model's forward does
        h = h * torch.tensor(s.hidden**0.5, dtype=h.dtype, device=h.device)
    masks: dict[int | None, torch.Tensor] = {}
    for key, block in model.layers.items():
        window = block.attn.window
        if window not in masks:
            masks[window] = _attention_mask(cache, t, window)
        cos, sin = _rope_at(model, int(key), positions)
        h = _block(block, h, cos, sin, cache, key, masks[window])
    cache.length += t
    logits = model.output(model.norm(h[:, -1:]))[:, 0]
    if s.final_logit_softcap is not None:
        logits = s.final_logit_softcap * torch.tanh(logits / s.final_logit_softcap)
    return logits[..., : s.vocab]
