"""`charlm`: a small causal transformer over the bytes of the Python standard library's own source files.

Every Python installation carries this text, so nothing is downloaded. The files are read in sorted order until
`max_chars` bytes; the exact text depends on the Python version (recorded in each trial's reproducibility record).
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.tasks.base import Task, accuracy_sum

__all__ = ["CharTransformer", "charlm", "load_stdlib_text", "unigram_surprisal"]

VOCAB = 256  # bytes
MAX_LAYERS = 1000  # transformer blocks
MODEL_DEFAULTS = {"d_model": 128, "n_layers": 2, "n_heads": 4, "mlp_ratio": 4, "dropout": 0.0}


def load_stdlib_text(max_chars: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_chars:
            break
    text = b"".join(chunks)[:max_chars]
    if len(text) < max_chars // 2:
        raise FileNotFoundError(f"task_args.max_chars: {max_chars} asked for, but this Python's standard-library "
                                f"source under {root} holds {len(text)} bytes: ask for at most that")
    return text


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, context: int, d_model: int, n_layers: int, n_heads: int, mlp_ratio: int,
                 dropout: float) -> None:
        super().__init__()
        if n_heads < 1:
            raise ValueError(f"model.n_heads must be at least 1, but got {n_heads=}")
        if d_model < 1:  # 0 is divisible by any n_heads: a model of no width trained to a uniform guess
            raise ValueError(f"model.d_model must be at least 1, but got {d_model=}")
        if mlp_ratio < 1:
            raise ValueError(f"model.mlp_ratio must be at least 1, but got {mlp_ratio=}")
        if d_model % n_heads:
            raise ValueError(f"model.d_model must be divisible by model.n_heads, but got {d_model=}, {n_heads=}")
        if not 1 <= n_layers <= MAX_LAYERS:  # each block is modules: a million of them take minutes to build
            raise ValueError(f"model.n_layers must be in [1, {MAX_LAYERS}], but got {n_layers=}")
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(context, d_model)
        blocks = [Block(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings: fewer parameters, better small models
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in blocks:  # scale residual projections by depth (GPT-2)
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def unigram_surprisal(windows: np.ndarray) -> np.ndarray:
    """Per-window difficulty: the mean surprisal (-log p) of its bytes under the training text's own byte frequencies.

    This is the loss of the simplest language model, so it ranks windows the way a model first meets them: plain
    English and indentation (common bytes) are easy, dense punctuation, digits and non-ASCII bytes are hard. Add-one
    smoothing keeps unseen bytes finite."""
    counts = np.bincount(windows.reshape(-1), minlength=VOCAB).astype(np.float64)
    surprisal = -np.log((counts + 1.0) / (counts.sum() + VOCAB))
    return surprisal[windows].mean(axis=1)


def charlm(context: int = 128, max_chars: int = 1_000_000, val_fraction: float = 0.1) -> Task:
    """The text is cut into non-overlapping windows of `context + 1` bytes; the last `val_fraction` of them, a
    contiguous stretch of files, is the validation set."""
    if context < 2:
        raise ValueError(f"task_args.context must be >= 2, but got {context=}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"task_args.val_fraction must be in (0, 1), but got {val_fraction=}")
    if max_chars < 1:  # -1 sliced the text's last byte off, silently
        raise ValueError(f"task_args.max_chars must be >= 1, but got {max_chars=}")
    data = np.frombuffer(load_stdlib_text(max_chars), dtype=np.uint8)
    n = len(data) // (context + 1)
    windows = torch.from_numpy(data[: n * (context + 1)].astype(np.int64)).view(n, context + 1)
    n_val = max(1, round(n * val_fraction))
    train, val = windows[:-n_val], windows[-n_val:]

    def build(cfg: dict[str, Any]) -> nn.Module:
        return CharTransformer(context, **cfg)

    def difficulty() -> np.ndarray:  # computed only when a curriculum asks for it
        return unigram_surprisal(train.numpy())

    return Task(
        name="charlm",
        train=(train[:, :-1].contiguous(), train[:, 1:].contiguous()),
        val=(val[:, :-1].contiguous(), val[:, 1:].contiguous()),
        build_model=build,
        model_defaults=MODEL_DEFAULTS,
        eval_metrics=accuracy_sum,
        eval_metric_names=("accuracy",),
        tokens_per_sample=context,
        difficulty=difficulty,
    )
