"""Small models and data for the reproductions (FP16 widths <= 128: CPU FP16 is slow)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def mlp(d_in=32, width=64, d_out=4, depth=2, seed=0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, d_out))


def classes(n, batch=32, d_in=32, k=4, noise=0.0, seed=1):
    """A linearly separable k-class problem; ``noise``: share of labels drawn at random."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, k, generator=g)
    for _ in range(n):
        x = torch.randn(batch, d_in, generator=g)
        y = (x @ w).argmax(-1)
        if noise:
            flip = torch.rand(batch, generator=g) < noise
            y = torch.where(flip, torch.randint(0, k, (batch,), generator=g), y)
        yield x, y


def regression(n, batch=32, d_in=32, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, 1, generator=g) / math.sqrt(d_in)
    for _ in range(n):
        x = torch.randn(batch, d_in, generator=g)
        yield x, (x @ w + 0.1 * torch.randn(batch, 1, generator=g)) * scale


# -- a tiny causal language model ------------------------------------------------------------------------------------
class CausalAttention(nn.Module):
    def __init__(self, d, seq, scaled=True):
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.scaled = scaled
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril())

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        if self.scaled:
            q = q / math.sqrt(q.shape[-1])
        att = (q @ k.transpose(-2, -1)).masked_fill(~self.mask, float("-inf")).softmax(-1)
        return self.o(att @ v)


class Block(nn.Module):
    def __init__(self, d, seq, scaled=True):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalAttention(d, seq, scaled)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab=64, d=64, seq=16, depth=2, scaled=True, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.Sequential(*[Block(d, seq, scaled) for _ in range(depth)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.ln(self.blocks(self.emb(tokens) + self.pos)))


def sequences(n, batch=8, seq=16, vocab=64, seed=1):
    """Learnable next-token data: each sequence steps through the vocabulary by a stride of 3 from a random start."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.arange(seq + 1)
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        t = (start + 3 * steps) % vocab
        yield t[:, :-1], t[:, 1:]


def lm_loss(out, y):
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def noise_tokens(n, batch=8, seq=16, vocab=64, seed=1):
    """Random tokens: nothing to learn beyond chance (ln vocab)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield t[:, :-1], t[:, 1:]


class Attention(nn.Module):
    """``scale``: "before" scales q by 1/sqrt(d) before the product, "after" scales the product (q @ k^T itself can
    overflow FP16 first), None leaves it out."""

    def __init__(self, d, scale="before"):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.scale = scale

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.scale == "before":
            q = q / math.sqrt(q.shape[-1])
        s = q @ k.transpose(-2, -1)
        if self.scale == "after":
            s = s / math.sqrt(q.shape[-1])
        return self.o(torch.softmax(s, dim=-1) @ v)


class TokenClassifier(nn.Module):
    """Embedding (scaled, as sqrt(d)-style embedding scales do), attention without a norm before it, mean pool."""

    def __init__(self, vocab=50, d=32, classes=2, scale="before", emb_scale=30.0, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.emb_scale = emb_scale
        self.attn = Attention(d, scale)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        x = self.emb(tokens) * self.emb_scale
        return self.head(self.ln(x + self.attn(x)).mean(1))


def token_classes(n, batch=16, seq=12, vocab=50, seed=1):
    """Two classes: which half of the vocabulary a sequence draws more tokens from."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        yield x, ((x < vocab // 2).sum(1) * 2 > seq).long()


class PixelSegmenter(nn.Module):
    """A per-pixel classifier (a 1x1-convolution network, written with Linear) ending in a Sigmoid."""

    def __init__(self, d_in=4, width=8, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, 1))
        self.sigmoid = nn.Sigmoid()

    def forward(self, x):
        return self.sigmoid(self.body(x).squeeze(-1))


def masks(n, batch=64, pixels=4096, d_in=4, seed=1):
    """Segmentation masks (70% foreground) a linear function of the pixel features predicts."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, generator=g)
    for _ in range(n):
        x = torch.randn(batch, pixels, d_in, generator=g)
        yield x, (x @ w > -0.5).float()
