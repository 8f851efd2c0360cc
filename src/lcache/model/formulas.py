"""The arithmetic of LLM training, one function per published formula.

Every function names its source. Sizes are bytes, times seconds, compute FLOPs. These are pure
functions of numbers so that tests can check each one against a hand-computed case.
"""

from __future__ import annotations

from lcache.errors import ConfigError
from lcache.model.presets import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
RECOMPUTE = ("none", "selective", "full")


def dtype_bytes(name: str) -> int:
    """Bytes per element of ``fp32``, ``bf16``, ``fp16`` or ``fp8``."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; choose one of "
                          f"{', '.join(DTYPE_BYTES)}") from None


def params_per_layer(m: ModelShape) -> int:
    """Parameters of one transformer layer.

    DLIO's formula (argonne-lcf/dlio_benchmark ``BaseCheckpointing.get_num_parameters``, used by
    MLPerf Storage v2.0): two norms of h, Q/K/V of h x (h + 2 d_kv) with d_kv = h/a x kv_heads,
    the output projection h x h, and an MLP of 3 h x ffn (gated: gate, up, down) or 2 h x ffn.
    Biases (GPT-3, BERT) add h + 2 d_kv + h to attention and ffn + h to the MLP; LayerNorm has a
    bias beside each weight.
    """
    h = m.hidden
    d_kv = h // m.heads * m.kv_heads
    norms = 2 * h * (2 if m.norm == "layernorm" else 1)
    attention = h * (h + 2 * d_kv) + h * h
    mlp = (3 if m.gated_mlp else 2) * h * m.ffn_hidden
    if m.bias:
        attention += (h + 2 * d_kv) + h
        mlp += (m.ffn_hidden if not m.gated_mlp else 2 * m.ffn_hidden) + h
    return norms + attention + mlp


def param_count(m: ModelShape) -> int:
    """All parameters: layers, token embedding, LM head (unless tied), positions, final norm.

    For Llama shapes this is DLIO's ``get_num_parameters`` exactly:
    ``V h + L (2h + h (h + 2 d_kv) + h^2 + 3 h ffn) + h + V h``.
    """
    h = m.hidden
    embeddings = m.vocab * h * (1 if m.tied_embeddings else 2) + m.position_embeddings * h
    final_norm = h * (2 if m.norm == "layernorm" else 1)
    return m.layers * params_per_layer(m) + embeddings + final_norm + m.extra_params


def checkpoint_bytes_per_param(weight_dtype: str = "bf16", master_dtype: str = "fp32",
                               optimizer_state_dtype: str = "fp32") -> int:
    """Bytes a mixed-precision Adam checkpoint holds per parameter: 14 with the defaults.

    Weights (2) + fp32 master copy (4) + Adam's m and v (4 + 4); gradients are not saved. This
    is what DLIO writes (``model_datatype`` fp16 + 3 x ``optimizer_datatype`` fp32 groups).
    """
    return dtype_bytes(weight_dtype) + optimizer_bytes_per_param(master_dtype,
                                                                 optimizer_state_dtype)


def optimizer_bytes_per_param(master_dtype: str = "fp32",
                              optimizer_state_dtype: str = "fp32") -> int:
    """Adam's state per parameter: master weights + first and second moments (12 B in fp32)."""
    return dtype_bytes(master_dtype) + 2 * dtype_bytes(optimizer_state_dtype)


def memory_bytes_per_param(weight_dtype: str = "bf16", grad_dtype: str = "bf16",
                           master_dtype: str = "fp32", optimizer_state_dtype: str = "fp32") -> int:
    """Model-state bytes in memory per parameter: 16 for mixed-precision Adam.

    Rajbhandari et al. 2020 (ZeRO), section 3.1: 2 (fp16 weights) + 2 (fp16 gradients) +
    K = 12 (fp32 master, momentum, variance).
    """
    return (dtype_bytes(weight_dtype) + dtype_bytes(grad_dtype)
            + optimizer_bytes_per_param(master_dtype, optimizer_state_dtype))


def model_state_bytes_per_gpu(params: int, *, tp: int, pp: int, dp: int, zero_stage: int,
                              weight_bytes: int, grad_bytes: int, optimizer_bytes: int,
                              optimizer_offloaded: bool = False) -> dict[str, float]:
    """Weights, gradients and optimizer state one GPU holds.

    TP and PP split every tensor ``tp x pp`` ways (Narayanan et al. 2021); ZeRO (Rajbhandari et
    al. 2020, Figure 1) further divides by ``dp`` the optimizer state from stage 1, the
    gradients from stage 2 and the weights from stage 3. An offloaded optimizer leaves the GPU.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    shard = params / (tp * pp)
    weights = shard * weight_bytes / (dp if zero_stage >= 3 else 1)
    grads = shard * grad_bytes / (dp if zero_stage >= 2 else 1)
    optimizer = 0.0 if optimizer_offloaded else \
        shard * optimizer_bytes / (dp if zero_stage >= 1 else 1)
    return {"weights_bytes": weights, "gradients_bytes": grads, "optimizer_bytes": optimizer}


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, *, tp: int = 1,
                               recompute: str = "none", sequence_parallel: bool = True) -> float:
    """Activation bytes one GPU keeps for backward, per transformer layer and micro-batch.

    Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models'
    (16-bit activations; s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size):

    - no recomputation, no parallelism (eq. 1): ``s b h (34 + 5 a s / h)``;
      with TP (eq. 2): ``s b h (10 + 24/t + 5 a s / (h t))``; with TP + sequence parallelism
      (eq. 4): ``s b h / t (34 + 5 a s / h)``;
    - selective recomputation (the ``5 a s / h`` attention-score term is recomputed, eq. 6):
      ``34 s b h / t`` with SP, ``s b h (10 + 24/t)`` without;
    - full recomputation (only each layer's input is kept, section 4.1): ``2 s b h`` (/ t with SP).

    The 34 and 5as/h coefficients were derived for GPT layers (4h MLP, MHA); for gated or GQA
    layers they are an approximation.
    """
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    t = tp
    sp = sequence_parallel and t > 1
    attn_scores = 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if sp:
        core = 34.0 + (attn_scores if recompute == "none" else 0.0)
        return s * b * h / t * core
    core = 10 + 24 / t + (attn_scores / t if recompute == "none" else 0.0)
    return s * b * h * core


def flops_per_token(m: ModelShape, params: int | None = None) -> float:
    """Training FLOPs per token: ``6 N + 12 L h s``.

    6 N: each parameter does a multiply-add (2 FLOPs) per token forward and twice that backward
    (Kaplan et al. 2020 section 2.1; Narayanan et al. 2021 section 5.1). 12 L h s: attention's
    QK^T and AV products, which do not scale with N (Chowdhery et al. 2022, PaLM appendix B:
    ``6N + 12 L H Q T`` with H Q = h and T = s). Recomputation is not counted: MFU is defined on
    the model's FLOPs.
    """
    n = param_count(m) if params is None else params
    return 6.0 * n + 12.0 * m.layers * m.hidden * m.seq_len


def step_time_s(*, tokens_per_step: float, flops_per_token: float, gpus: int,
                peak_flops: float, mfu: float) -> float:
    """Seconds per optimizer step: model FLOPs / (GPUs x peak x MFU) (PaLM appendix B)."""
    return tokens_per_step * flops_per_token / (gpus * peak_flops * mfu)


def token_bytes_for_vocab(vocab: int) -> int:
    """Bytes per token on disk in a Megatron indexed dataset: uint16 below 65500 ids, else int32.

    Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, ``DType.optimal_dtype``.
    """
    return 2 if vocab < 65500 else 4
