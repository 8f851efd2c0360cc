"""Model shapes of the presets, each with its published source.

A :class:`ModelShape` holds what the parameter, FLOP and activation formulas need. Llama-3 shapes
count parameters exactly as DLIO / MLPerf Storage v2.0 do (gated MLP, untied LM head, RMSNorm, no
biases); GPT-3 and BERT set the flags that make their published totals come out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lcache.errors import ConfigError

NORMS = ("rmsnorm", "layernorm")


#: the largest each dimension may be: far past any published model, and small enough that
#: the figures stay finite and readable
MAX_DIMENSIONS = {"layers": 10_000, "hidden": 1 << 20, "ffn_hidden": 1 << 22,
                  "heads": 1 << 16, "kv_heads": 1 << 16, "vocab": 1 << 24, "seq_len": 1 << 24,
                  "position_embeddings": 1 << 24, "extra_params": 10**12}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder- or encoder-only transformer's shape.

    Attributes:
        name: label shown in reports.
        layers: transformer layers (L).
        hidden: model width (h).
        ffn_hidden: MLP inner width.
        heads: attention heads (a).
        kv_heads: key/value heads (grouped-query attention); equal to ``heads`` for MHA.
        vocab: vocabulary size (V).
        seq_len: training sequence length in tokens (s).
        gated_mlp: SwiGLU-style MLP with three weight matrices (Llama) instead of two (GPT, BERT).
        tied_embeddings: the LM head shares the input embedding's weights.
        bias: linear layers carry biases (GPT-3, BERT).
        norm: ``rmsnorm`` (h weights) or ``layernorm`` (h weights + h biases).
        position_embeddings: rows of a learned position table (0 for rotary).
        extra_params: parameters outside the layers and embeddings (BERT's pooler, token types).
        source: where the shape was published.
    """

    name: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    gated_mlp: bool = True
    tied_embeddings: bool = False
    bias: bool = False
    norm: str = "rmsnorm"
    position_embeddings: int = 0
    extra_params: int = 0
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {self.name!r}: {key} must be a positive integer, "
                                  f"got {value!r}")
            if value > MAX_DIMENSIONS[key]:
                raise ConfigError(f"model {self.name!r}: {key} {value:,} is out of range: "
                                  f"give 1 to {MAX_DIMENSIONS[key]:,}")
        for key in ("gated_mlp", "tied_embeddings", "bias"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"model {self.name!r}: {key} must be true or false, "
                                  f"got {getattr(self, key)!r}")
        for key in ("position_embeddings", "extra_params"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"model {self.name!r}: {key} must be an integer >= 0, "
                                  f"got {value!r}")
            if value > MAX_DIMENSIONS[key]:
                raise ConfigError(f"model {self.name!r}: {key} {value:,} is out of range: "
                                  f"give 0 to {MAX_DIMENSIONS[key]:,}")
        if self.hidden % self.heads:
            raise ConfigError(f"model {self.name!r}: hidden {self.hidden} is not a multiple of "
                              f"heads {self.heads}; the head size must be a whole number")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model {self.name!r}: heads {self.heads} is not a multiple of "
                              f"kv_heads {self.kv_heads}")
        if self.norm not in NORMS:
            raise ConfigError(f"model {self.name!r}: norm {self.norm!r} is not one of "
                              f"{', '.join(NORMS)}")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


_LLAMA3_SOURCE = ("Dubey et al. 2024, 'The Llama 3 Herd of Models', Table 3; "
                  "meta-llama/{repo} config.json (vocab 128256, max_position_embeddings 8192)")

PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(
        "llama3-8b", layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8,
        vocab=128256, seq_len=8192, source=_LLAMA3_SOURCE.format(repo="Meta-Llama-3-8B")),
    "llama3-70b": ModelShape(
        "llama3-70b", layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8,
        vocab=128256, seq_len=8192, source=_LLAMA3_SOURCE.format(repo="Meta-Llama-3-70B")),
    "llama3-405b": ModelShape(
        "llama3-405b", layers=126, hidden=16384, ffn_hidden=53248, heads=128, kv_heads=8,
        vocab=128256, seq_len=8192, source=_LLAMA3_SOURCE.format(repo="Llama-3.1-405B")),
    # Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 (175.0B: 96 layers,
    # d_model 12288, 96 heads of 128, context 2048); GPT-2 BPE vocabulary of 50257; learned
    # positions; LM head tied to the embedding; d_ff = 4 d_model.
    "gpt3-175b": ModelShape(
        "gpt3-175b", layers=96, hidden=12288, ffn_hidden=49152, heads=96, kv_heads=96,
        vocab=50257, seq_len=2048, gated_mlp=False, tied_embeddings=True, bias=True,
        norm="layernorm", position_embeddings=2048,
        source="Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1"),
    # Devlin et al. 2019, 'BERT', section 3 (L=24, H=1024, A=16, 340M); uncased WordPiece vocab
    # 30522, 512 positions, 2 token types, pooler; 335,141,888 parameters in
    # transformers' BertModel('bert-large-uncased'). extra = token types (2h) + pooler (h*h + h).
    "bert-large": ModelShape(
        "bert-large", layers=24, hidden=1024, ffn_hidden=4096, heads=16, kv_heads=16,
        vocab=30522, seq_len=512, gated_mlp=False, tied_embeddings=True, bias=True,
        norm="layernorm", position_embeddings=512, extra_params=2 * 1024 + 1024 * 1024 + 1024,
        source="Devlin et al. 2019, 'BERT: Pre-training of Deep Bidirectional Transformers', "
               "section 3; google-bert/bert-large-uncased config.json"),
}

# Training settings each preset starts from (overridable). The Llama-3 parallelism is MLPerf
# Storage v2.0's (mlcommons/storage configs/dlio/workload/llama3_*.yaml: 8B TP1 PP1 ZeRO-3 on 8
# GPUs, 70B TP8 PP1 ZeRO-3 on 64, 405B TP8 PP32 DP2 ZeRO-1 on 512); GPT-3 175B is Narayanan et
# al. 2021, Table 1 (TP8 PP8 on 1024 GPUs, batch 1536). Global batches of 512 x 8192 tokens are
# Llama 3's initial 4M-token batch (Dubey et al. 2024, section 3.4.1).
PRESET_TRAINING: dict[str, dict[str, Any]] = {
    "llama3-8b": {"gpus": 8, "tp": 1, "pp": 1, "zero_stage": 3, "global_batch": 512},
    "llama3-70b": {"gpus": 64, "tp": 8, "pp": 1, "zero_stage": 3, "global_batch": 512},
    "llama3-405b": {"gpus": 512, "tp": 8, "pp": 32, "zero_stage": 1, "global_batch": 512},
    "gpt3-175b": {"gpus": 1024, "tp": 8, "pp": 8, "zero_stage": 1, "global_batch": 1536},
    "bert-large": {"gpus": 8, "tp": 1, "pp": 1, "zero_stage": 0, "global_batch": 256,
                   "micro_batch": 32},
}


def get_preset(name: str, where: str = "", alternative: str = "") -> ModelShape:
    """The preset's shape; the error lists the presets there are, says ``where`` the name
    was given (" in m.yaml") and offers the caller's ``alternative`` ("a model file
    (--model-file)"), if it has one."""
    try:
        return PRESETS[name.lower()]
    except (KeyError, AttributeError):  # AttributeError: not a str (5 has no lower())
        raise ConfigError(f"unknown model preset {name!r}{where}; choose one of "
                          f"{', '.join(PRESETS)}" + (f" or give {alternative}" if alternative
                                                      else "")) from None
