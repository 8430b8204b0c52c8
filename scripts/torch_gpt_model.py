"""lockstep's GPT in PyTorch: the other side of the transformer's reference cases.

This file owns the PyTorch model that scripts/torch_gpt.py (the cases of tests/data/gpt/)
and scripts/torch_gpt_bench.py (the speed comparison of docs/performance.md) train. It is
the decoder that `--model gpt` builds (src/models.rs): GPT-2's pre-norm blocks in the
layout nanoGPT made common, with the same parameter names, so a state_dict of this model
and lockstep's weights name the same tensors:

    transformer.wte.weight                 (V, C)   token table, tied to lm_head.weight
    transformer.wpe.weight                 (T, C)   position table
    transformer.h.{i}.ln_1.{weight,bias}   (C,)
    transformer.h.{i}.attn.c_attn.*        (3C, C), (3C,)   q, k, v in that order
    transformer.h.{i}.attn.c_proj.*        (C, C), (C,)
    transformer.h.{i}.ln_2.{weight,bias}   (C,)
    transformer.h.{i}.mlp.c_fc.*           (4C, C), (4C,)
    transformer.h.{i}.mlp.c_proj.*         (C, 4C), (C,)
    transformer.ln_f.{weight,bias}         (C,)
    lm_head.weight                         (V, C)   the token table again

Shapes, as in the Rust code: N batch, T time (positions), C width (n_embd), H heads,
D = C / H a head's width, V vocabulary.

What it leaves to others: the data, the schedule and the loop are the scripts'; the
optimiser is PyTorch's AdamW, grouped here the way lockstep decays (see
`GPT.configure_optimizers`).

The construction order is part of the contract. The references of tests/data/gpt/ are
drawn from torch's generator in the order the modules below are built and initialised;
moving a layer or an init call changes every reference weight.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

LAYER_NORM_EPS = 1e-5
INIT_STD = 0.02


@dataclass
class GPTConfig:
    """The model's sizes. `bias` gives every dense layer and LayerNorm a bias (lockstep's
    GPT has them); `dropout` is the probability of the dropouts, 0 in every case here."""

    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """Normalises the last dimension to mean 0, variance 1 (eps 1e-5), then scales by
    `weight` and, when there is one, shifts by `bias` (absent from the state_dict when
    bias=False, which torch.nn.LayerNorm did not allow before 2.1)."""

    def __init__(self, width, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x):
        # x: (..., C) -> (..., C)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, LAYER_NORM_EPS)


class CausalSelfAttention(nn.Module):
    """Multi-head attention in which position t sees positions 0..=t.

    One dense layer `c_attn` makes q, k and v side by side (q first); each is cut into H
    heads of width D; softmax(q·kᵀ/√D), masked above the diagonal, weighs v; the heads are
    put back side by side and `c_proj` mixes them. PyTorch's fused
    scaled_dot_product_attention does the middle part (is_causal=True is the mask).
    """

    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")
        width = config.n_embd
        self.n_head = config.n_head
        self.p_drop = config.dropout
        self.c_attn = nn.Linear(width, 3 * width, bias=config.bias)
        self.c_proj = nn.Linear(width, width, bias=config.bias)
        self.out_drop = nn.Dropout(config.dropout)

    def forward(self, x):
        # x: (N, T, C) -> (N, T, C)
        n, t, c = x.shape
        h = self.n_head

        def by_head(z):
            # (N, T, C) -> (N, H, T, D), a view
            return z.view(n, t, h, c // h).transpose(1, 2)

        q, k, v = map(by_head, self.c_attn(x).chunk(3, dim=-1))
        p = self.p_drop if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (N, H, T, D)
        y = y.transpose(1, 2).reshape(n, t, c)  # heads side by side again: (N, T, C)
        return self.out_drop(self.c_proj(y))


class MLP(nn.Module):
    """The block's feed-forward half: C -> 4C, GELU (the exact, erf form), 4C -> C."""

    def __init__(self, config):
        super().__init__()
        width = config.n_embd
        self.c_fc = nn.Linear(width, 4 * width, bias=config.bias)
        self.c_proj = nn.Linear(4 * width, width, bias=config.bias)
        self.out_drop = nn.Dropout(config.dropout)

    def forward(self, x):
        # x: (N, T, C) -> (N, T, 4C) -> (N, T, C)
        hidden = F.gelu(self.c_fc(x), approximate="none")
        return self.out_drop(self.c_proj(hidden))


class Block(nn.Module):
    """One pre-norm transformer layer: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config):
        super().__init__()
        # Built in this order (ln_1, attn, ln_2, mlp): see the module's docstring.
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        # x: (N, T, C) -> (N, T, C)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` blocks, a final LayerNorm and a head that
    is the token table (weight tying). `model(ids, targets)` returns (logits, mean
    cross-entropy); without targets the loss is None."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        c = config.n_embd
        stack = nn.ModuleDict()
        stack["wte"] = nn.Embedding(config.vocab_size, c)
        stack["wpe"] = nn.Embedding(config.block_size, c)
        stack["drop"] = nn.Dropout(config.dropout)
        stack["h"] = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        stack["ln_f"] = LayerNorm(c, config.bias)
        self.transformer = stack
        self.lm_head = nn.Linear(c, config.vocab_size, bias=False)
        stack.wte.weight = self.lm_head.weight

        # Every dense and embedding weight ~ N(0, 0.02²), biases 0, in module order. The
        # tied table is visited twice (as wte, then as lm_head): the second draw is the
        # one kept, and the first one's draws stay, as the references were made with them.
        self.apply(_init_weights)
        # The two projections that add into each block's residual stream get a smaller
        # spread, 0.02/√(2·n_layer), so the stream's variance does not grow with depth.
        residual_std = INIT_STD / math.sqrt(2 * config.n_layer)
        for block in stack.h:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def forward(self, ids, targets=None):
        # ids, targets: (N, T) token ids, T <= block_size
        n, t = ids.shape
        if t > self.config.block_size:
            raise ValueError(f"{t} positions, but the position table has {self.config.block_size}")
        stack = self.transformer
        positions = torch.arange(t, device=ids.device)  # (T,)
        x = stack.drop(stack.wte(ids) + stack.wpe(positions))  # (N, T, C)
        for block in stack.h:
            x = block(x)
        logits = self.lm_head(stack.ln_f(x))  # (N, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with lockstep's decay rule (optim::DecayOn::Weights): the tensors of 2 or
        more dimensions (the dense and embedding weights) decay by `weight_decay`, the
        vectors (biases, LayerNorm scales and shifts) do not. PyTorch's fused kernel on CUDA, its default elsewhere."""
        trainable = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ]
        extra = {"fused": True} if device_type == "cuda" else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)


def _init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
