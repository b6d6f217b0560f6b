"""A GPT-2-style causal language model, built from a config (no weights are downloaded).

Pre-norm transformer blocks (LayerNorm, causal multi-head self-attention, LayerNorm, a 4x GELU
MLP), learned positions, and an output head tied to the token embedding, as in GPT-2
(Radford et al., 2019, "Language Models are Unsupervised Multitask Learners"). The sizes in
:data:`SIZES` span 0.45M to 300M parameters; :func:`config_for_megabytes` picks a width for a
float32 size, which the memory benchmark (``benchmarks/memory.py``) uses.

The model takes token ids ``(batch, context)`` and returns logits ``(batch, context, vocab)``;
:func:`lm_loss` is the next-token cross-entropy on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A GPT's shape."""

    vocab: int = 256
    """Tokens (256: bytes)."""
    context: int = 64
    """The longest sequence it reads (positions learned for each)."""
    width: int = 128
    """The embedding and residual width (``heads`` must divide it)."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads per block."""

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "width", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig.width {self.width} is not a multiple of heads {self.heads}; "
                "choose a width divisible by the number of heads"
            )

    @property
    def parameters(self) -> int:
        """Its parameter count (the tied head counted once)."""
        w = self.width
        block = 12 * w**2 + 13 * w  # attention 4 w^2 + 4 w, MLP 8 w^2 + 5 w, 2 norms 4 w
        return (self.vocab + self.context) * w + self.layers * block + 2 * w


SIZES = {
    "tiny": GPTConfig(width=128, layers=2, heads=4),
    "small": GPTConfig(width=256, layers=4, heads=8, context=128),
    "gpt2-76m": GPTConfig(vocab=256, context=256, width=768, layers=11, heads=12),
}
"""Named shapes: ``tiny`` (0.44M parameters, 1.75 MB in float32), ``small`` (3.3M, 13 MB),
``gpt2-76m`` (GPT-2 small's blocks, 11 of them, over bytes: 78M parameters, 313 MB)."""


def config_for_megabytes(megabytes: float, *, context: int = 128) -> GPTConfig:
    """A config over bytes of about ``megabytes`` of float32 parameters: the number of blocks
    (2 to 12) and the width (a multiple of 64, 64 per head) that come nearest, fewer blocks
    on a tie."""
    target = megabytes * 1e6 / 4
    best: GPTConfig | None = None
    for layers in range(2, 13):
        for width in range(64, 8192 + 1, 64):
            config = GPTConfig(context=context, width=width, layers=layers, heads=width // 64)
            if best is None or abs(config.parameters - target) < abs(best.parameters - target):
                best = config
    assert best is not None
    return best


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.norm2 = nn.LayerNorm(config.width)
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm, the tied head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.context, config.width)
        blocks = [Block(config) for _ in range(config.layers)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(config.width)
        self.apply(self._init)
        for block in blocks:  # GPT-2's scaled init of the residual projections
            for layer in (block.proj, block.down):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.config.context:
            raise ValueError(
                f"a sequence of {length} tokens is longer than the model's context "
                f"{self.config.context}; cut the text into pieces of at most that"
            )
        positions = torch.arange(length, device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.T  # the head tied to the embedding


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: ``logits`` (batch, length, vocab), ``targets`` (batch,
    length), each target the token after its position's input."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
