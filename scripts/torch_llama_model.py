"""lockstep's Llama in PyTorch: the other side of the Llama's reference case.

This file owns the PyTorch model that scripts/torch_llama.py (the case of
tests/data/llama/) and scripts/torch_llama_bench.py (the speed comparison of
docs/transformers.md) train. It is the decoder that `--model llama` builds
(src/models.rs, `llama`): Meta's Llama architecture (pre-norm RMSNorm blocks, rotary
position embeddings on the queries and keys, a SwiGLU feed-forward, no biases, an untied
output head), with Meta's parameter names, so a state_dict of this model and lockstep's
weights name the same tensors:

    tok_embeddings.weight                        (V, C)   token table (no position table)
    layers.{i}.attention_norm.weight             (C,)
    layers.{i}.attention.{wq,wk,wv,wo}.weight    (C, C)
    layers.{i}.ffn_norm.weight                   (C,)
    layers.{i}.feed_forward.{w1,w3}.weight       (F, C)
    layers.{i}.feed_forward.w2.weight            (C, F)
    norm.weight                                  (C,)
    output.weight                                (V, C)   its own tensor (untied)

Shapes, as in the Rust code: N batch, T time (positions), C width (dim), H heads,
D = C / H a head's width (even: RoPE turns pairs), F the feed-forward's hidden width
(`ffn_hidden`: Meta's rule), V vocabulary.

What it leaves to others: the data, the schedule and the loop are the scripts'; the
optimiser is PyTorch's AdamW, grouped as lockstep decays (`Llama.configure_optimizers`).
There is no dropout (Meta's Llama has none) and no cache of keys and values (training
only: every forward sees whole windows from position 0).

Initialisation: Meta's code defines none (its weights are loaded); this module's, like
lockstep's, is nanoGPT's rule carried over: every Linear and Embedding weight N(0, 0.02²),
the two projections that add into the residual stream (attention.wo and
feed_forward.w2) N(0, (0.02/√(2·n_layers))²), the RMSNorm weights ones. The reference
case copies its initial weights to lockstep, so the draws themselves are this file's.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

INIT_STD = 0.02


def ffn_hidden(dim, multiple_of, ffn_dim_multiplier=None):
    """Meta's hidden width of the SwiGLU feed-forward for width `dim` (its FeedForward's
    __init__, given 4·dim): two thirds of 4·dim (so the three matrices hold about as many
    weights as a 4·dim MLP's two), scaled by ffn_dim_multiplier if any, rounded up to a
    multiple of `multiple_of`. dim 128, multiple_of 256: int(2·512/3) = 341 → 512."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class LlamaConfig:
    """The model's sizes, Meta's ModelArgs by their names (max_seq_len the window T)."""

    max_seq_len: int
    vocab_size: int
    n_layers: int
    n_heads: int
    dim: int
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    """x / √(mean(x²) + eps) · weight over the last dimension (Meta's RMSNorm, computed in
    float32 as the inputs are)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x: (..., C) -> (..., C)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(t, d, theta):
    """Meta's precompute_freqs_cis as its real and imaginary parts: angle p·θ^(−2i/D) of
    position p and pair i, in float32; cos, sin: (T, D/2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    angles = torch.outer(torch.arange(t, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Meta's apply_rotary_emb in real arithmetic: each pair (x[2i], x[2i+1]) of a head,
    read as the complex x[2i] + i·x[2i+1], times cos + i·sin of its position's angle.
    x: (N, T, H, D); cos, sin: (T, D/2) -> (N, T, H, D)."""
    n, t, h, d = x.shape
    pairs = x.reshape(n, t, h, d // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # (N, T, H, D/2)
    c, s = cos[:t, None, :], sin[:t, None, :]  # (T, 1, D/2)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).reshape(n, t, h, d)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary positions: q, k, v by three bias-free
    projections, cut into H heads of width D, RoPE on q and k, softmax(q·kᵀ/√D) under the
    causal mask weighing v (PyTorch's fused scaled_dot_product_attention), the heads put
    back side by side and mixed by wo."""

    def __init__(self, config):
        super().__init__()
        if config.dim % config.n_heads != 0 or (config.dim // config.n_heads) % 2 != 0:
            raise ValueError(f"dim {config.dim} is not n_heads {config.n_heads} heads of an even width")
        self.n_heads = config.n_heads
        dim = config.dim
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        # x: (N, T, C) -> (N, T, C)
        n, t, c = x.shape
        h = self.n_heads
        q = self.wq(x).view(n, t, h, c // h)  # (N, T, H, D)
        k = self.wk(x).view(n, t, h, c // h)
        v = self.wv(x).view(n, t, h, c // h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (N, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (N, H, T, D)
        y = y.transpose(1, 2).reshape(n, t, c)  # (N, T, C)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1(x)) · w3(x)), C -> F -> C, no biases."""

    def __init__(self, config):
        super().__init__()
        hidden = ffn_hidden(config.dim, config.multiple_of)
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)

    def forward(self, x):
        # x: (N, T, C) -> (N, T, F) -> (N, T, C)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm layer: h = x + attention(attention_norm(x)), then
    h + feed_forward(ffn_norm(h))."""

    def __init__(self, config):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, cos, sin):
        # x: (N, T, C) -> (N, T, C)
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embeddings, `n_layers` blocks, a final RMSNorm and an untied output head.
    `model(ids, targets)` returns (logits, mean cross-entropy); without targets the loss
    is None."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.max_seq_len, config.dim // config.n_heads, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

        # See the module's docstring: N(0, 0.02²) for every weight of a Linear or an
        # Embedding, in module order, then the residual projections' smaller spread.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
        residual_std = INIT_STD / math.sqrt(2 * config.n_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, mean=0.0, std=residual_std)
            nn.init.normal_(layer.feed_forward.w2.weight, mean=0.0, std=residual_std)

    def forward(self, ids, targets=None):
        # ids, targets: (N, T) token ids, T <= max_seq_len
        t = ids.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"{t} positions, but the rotary tables have {self.config.max_seq_len}")
        h = self.tok_embeddings(ids)  # (N, T, C)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        logits = self.output(self.norm(h))  # (N, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """AdamW with lockstep's decay rule (optim::DecayOn::Weights): the tensors of 2 or
        more dimensions (the projections and the tables) decay by `weight_decay`, the
        RMSNorm weights do not."""
        trainable = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)
