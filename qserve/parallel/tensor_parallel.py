"""Tensor-parallel model ranks (issue 24, second part): what rank r of `world` builds and loads.

Megatron's split, as vLLM lays it out: each rank runs its share of the attention heads (q/k/v
column-parallel, so a rank's heads are whole) and of the MLP width (gate/up column-parallel), and
the row-parallel o_proj and down_proj each give a partial sum that an all-reduce over the
group completes (`add_all_reduce`). Where the world divides the vocabulary, the embedding and
lm_head are split by vocabulary rows (`add_vocab_parallel`: lookups summed, logits
all-gathered); otherwise they stay whole. Norms are whole. Every rank ends a step with the
whole hidden state and the whole logits.

    config = rank_config(ModelConfig.from_pretrained(path), tp)  # heads, KV heads, MLP, vocab
    state = shard_state(checkpoint_state, tp, quantization, split_vocab)  # `shard` cuts
    add_all_reduce(model, tp, split_vocab)  # after o_proj and down_proj; embedding, lm_head

`loader.load_model(..., tp=TPRank(rank, world))` does all three. The Llama family and Gemma 3
(the same attention and MLP modules) with separate q/k/v and gate/up modules, and a world that
divides the heads and MLP width; dense, GPTQ (act-order too), AWQ, W8 and compressed-tensors
pack-quantized checkpoints, each linear cut in its own format (`shard`); where the world is a
multiple of the KV heads, each rank holds the one KV head its query heads read
(`kv_head_replicas`). What is not there yet is refused in one line: Phi-3's fused modules,
mixtures of experts. The engine's `--tensor-parallel-size` runs ranks 1.. in worker
processes (`workers`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from qserve.errors import QServeError
from qserve.model.config import ModelConfig
from qserve.model.gptq_linear import gptq_from_pack_quantized
from qserve.parallel.shard import column_shard, row_shard

__all__ = [
    "COLUMN",
    "ROW",
    "TPRank",
    "add_all_reduce",
    "kv_head_replicas",
    "rank_config",
    "shard_state",
]

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
EMBEDDING = "model.embed_tokens.weight"
KV = ("k_proj", "v_proj")
ROW = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class TPRank:
    """This process's place in a tensor-parallel group: rank `rank` of `world`, all-reducing
    over `group` (a torch.distributed ProcessGroup; None: the default group)."""

    rank: int
    world: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise QServeError(f"tensor-parallel rank {self.rank} outside a world of {self.world}")

    # what `loader.load_model(..., tp=...)` calls (the model code does not import this package)
    def rank_config(self, config: ModelConfig) -> ModelConfig:
        return rank_config(config, self)

    def shard_state(
        self, state: dict[str, torch.Tensor], full_config: ModelConfig
    ) -> dict[str, torch.Tensor]:
        split_vocab = vocab_parallel(full_config, self.world)
        replicas = kv_head_replicas(full_config, self.world)
        return shard_state(state, self, full_config.quantization, split_vocab, replicas)

    def add_all_reduce(self, model: nn.Module, full_config: ModelConfig) -> int:
        return add_all_reduce(model, self, vocab_parallel(full_config, self.world))


def rank_config(config: ModelConfig, tp: TPRank) -> ModelConfig:
    """The model config of one rank: its share of the attention heads, KV heads and MLP width
    (one KV head, replicated, where the world is a multiple of the KV heads: vLLM's
    `num_kv_head_replicas`). A QServeError names what does not split (vLLM refuses the same)."""
    w = tp.world
    if config.family not in ("llama", "gemma3"):  # the model classes with these module names
        raise QServeError(f"tensor parallelism does not take {config.architecture} yet")
    if config.num_experts:
        raise QServeError("tensor parallelism does not take mixture-of-experts models yet")
    if config.fused_projections:
        raise QServeError("tensor parallelism does not take fused qkv_proj / gate_up_proj yet")
    kv = config.num_key_value_heads
    for what, size in (
        ("attention heads", config.num_attention_heads),
        ("intermediate size", config.intermediate_size),
    ):
        if size % w:
            raise QServeError(
                f"{what} ({size}) do not split over --tensor-parallel-size {w}: it must divide them"
            )
    if kv % w and w % kv:
        raise QServeError(
            f"KV heads ({kv}) do not split over --tensor-parallel-size {w}: it must divide them "
            "or be a multiple of them (each rank then holds one KV head, replicated)"
        )
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // w,
        num_key_value_heads=max(kv // w, 1),
        intermediate_size=config.intermediate_size // w,
        vocab_size=config.vocab_size // w if vocab_parallel(config, w) else config.vocab_size,
    )


def kv_head_replicas(config: ModelConfig, world: int) -> int:
    """How many ranks hold each KV head: 1 where the world divides the KV heads, else
    world / KV heads (k_proj and v_proj are cut over the KV heads, not the ranks)."""
    return max(world // config.num_key_value_heads, 1)


def vocab_parallel(config: ModelConfig, world: int) -> bool:
    """Whether embed_tokens and lm_head are split by vocabulary rows (the world divides the
    vocabulary; otherwise both stay whole on every rank)."""
    return config.vocab_size % world == 0


def shard_state(
    state: dict[str, torch.Tensor],
    tp: TPRank,
    quantization: Any = None,
    split_vocab: bool = False,
    kv_replicas: int = 1,
) -> dict[str, torch.Tensor]:
    """Rank `tp.rank`'s share of a checkpoint's tensors: q/k/v and gate/up cut along their
    outputs, o_proj and down_proj along their inputs (bias on rank 0), with `split_vocab`
    (`vocab_parallel`) the embedding and lm_head by vocabulary rows, the rest whole. Each
    linear in its checkpoint format (`quantization`: the config's QuantScheme, None: dense).
    With `kv_replicas` > 1 (`kv_head_replicas`) k_proj and v_proj are cut into world /
    kv_replicas parts and rank r takes part r // kv_replicas: the KV head of its query heads."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix.rpartition(".")[2] in COLUMN + ROW or (split_vocab and prefix == "lm_head"):
            modules.setdefault(prefix, {})[suffix] = tensor
        elif split_vocab and name == EMBEDDING:  # [vocab, hidden]: this rank's rows
            out[name] = column_shard({"weight": tensor}, "dense", tp.rank, tp.world)["weight"]
        else:
            out[name] = tensor
    for prefix, tensors in modules.items():
        fmt, group_size = shard_format(prefix, tensors, quantization)
        if "weight_packed" in tensors:  # compressed-tensors 4/8-bit: the same codes as GPTQ's
            tensors = _gptq_tensors(prefix, tensors, quantization.for_module(prefix).bits)
        kind = prefix.rpartition(".")[2]
        if kind in KV and kv_replicas > 1:
            rank, parts = tp.rank // kv_replicas, tp.world // kv_replicas
            part = column_shard(tensors, fmt, rank, parts, name=prefix)
        elif kind in COLUMN or prefix == "lm_head":
            part = column_shard(tensors, fmt, tp.rank, tp.world, name=prefix)
        else:  # the model's module has a bias on every rank: zeros where rank 0 adds it
            part = row_shard(tensors, fmt, tp.rank, tp.world, group_size, name=prefix)
            if "bias" in tensors and "bias" not in part:
                part["bias"] = torch.zeros_like(tensors["bias"])
        out.update((f"{prefix}.{suffix}", t) for suffix, t in part.items())
    return out


def shard_format(
    prefix: str, tensors: dict[str, torch.Tensor], quantization: Any
) -> tuple[str, int]:
    """(`shard` format, group size) of one linear's checkpoint tensors: compressed-tensors'
    pack-quantized layers are cut as GPTQ (`_gptq_tensors`); act-order GPTQ cut along K keeps
    every group's scales and zeros on each rank (`shard.row_shard`)."""
    scheme = None if quantization is None else quantization.for_module(prefix)
    if scheme is None:
        return "dense", -1
    fmt = {"gptq": "gptq", "awq": "awq"}.get(scheme.format, "w8")
    return fmt, scheme.group_size


def _gptq_tensors(prefix: str, tensors: dict[str, torch.Tensor], bits: int) -> dict:
    """A pack-quantized linear's tensors in GPTQ v1 form (lossless), which `shard` cuts."""
    state = {f"{prefix}.{suffix}": t for suffix, t in tensors.items()}
    gptq_from_pack_quantized(prefix, state, bits)
    return {name.rpartition(".")[2]: t for name, t in state.items()}


def add_all_reduce(model: nn.Module, tp: TPRank, split_vocab: bool = False) -> int:
    """Sum every row-parallel linear's output over the group (a forward hook on each o_proj and
    down_proj, in place), and, where the vocabulary is split, complete the embedding and
    lm_head (`add_vocab_parallel`); returns how many linears it hooked."""
    import torch.distributed as dist

    def all_reduce(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=tp.group)
        return output

    hooked = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ROW:
            module.register_forward_hook(all_reduce)
            hooked += 1
    if split_vocab:
        add_vocab_parallel(model.model.embed_tokens, model.lm_head, tp)
    return hooked


def add_vocab_parallel(embed: nn.Module, lm_head: nn.Module, tp: TPRank) -> None:
    """Vocab-parallel embedding and lm_head (Megatron's): this rank holds vocabulary rows
    [rank * n, (rank + 1) * n). The embedding looks up the ids in its range (zeros elsewhere)
    and the all-reduce sums the ranks' rows; lm_head's logits of its rows are all-gathered,
    so every rank has the whole logits (rank 0 samples)."""
    import torch.distributed as dist

    n = embed.num_embeddings
    first = tp.rank * n

    def local_ids(module: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        module.qserve_inside = (ids >= first) & (ids < first + n)
        return ((ids - first).clamp(0, n - 1), *args[1:])

    def sum_rows(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(~module.qserve_inside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=tp.group)
        return out

    def gather_logits(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(out) for _ in range(tp.world)]
        dist.all_gather(parts, out.contiguous(), group=tp.group)
        return torch.cat(parts, dim=-1)

    embed.register_forward_pre_hook(local_ids)
    embed.register_forward_hook(sum_rows)
    lm_head.register_forward_hook(gather_logits)
