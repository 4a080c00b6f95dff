"""RoPE angle tables from the model description: the one definition both backends use.

    theta_j = rope_base ** (-2 j / head_dim),  j = 0 .. head_dim/2 - 1
    cos[p, j] = cos(p * theta_j),  sin[p, j] = sin(p * theta_j)   (angles in float64, stored float32)
"""
from __future__ import annotations

import numpy as np

from engine.formats.config import ModelConfig


def rope_tables(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, head_dim/2] for the given positions (angles computed in float64)."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
