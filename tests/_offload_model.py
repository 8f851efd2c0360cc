"""A tiny GPT-like model for the offload tests (seconds on a CPU) and their child scripts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

# ~11 sub-groups, params split across; through the page cache, as blocks this small take
# milliseconds each with O_DIRECT (the AMSGrad test and the file tests keep O_DIRECT)
SMALL = {"host_budget": "1MB", "sub_group_size": 3000, "direct": False}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Autouse in the modules that import it. Why: a 32k-parameter model gains nothing from
    threads, and torch's spinning intra-op threads run 10x slower on a loaded 2-core machine;
    the bits do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 32, layers: int = 2, heads: int = 2,
                 seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]])))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **kw: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw).to(dtype)


def batch(step: int, vocab: int = 97, seq: int = 16, n: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (n, seq), generator=g)


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       idx[:, 1:].reshape(-1))


def train(model: nn.Module, opt: object, steps: range) -> None:
    for s in steps:
        loss_of(model, batch(s)).backward()
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
