"""Batched token sampling: penalties, temperature, min-p / top-k / top-p, logprobs (vLLM v1 order).

One row per request that samples this step. Order of operations, as in vLLM v1's sampler:
1. logprobs from the raw logits (log_softmax before any processing);
2. allowed_token_ids: every other token masked to -inf (logits_processors);
3. bad words: the tokens that would complete one masked to -inf (logits_processors);
4. min_tokens: stop / EOS ids masked to -inf while a request is below its min_tokens;
5. logit_bias added (logits_processors);
6. repetition penalty (prompt + output tokens), then frequency and presence (output tokens);
7. greedy rows: argmax;
8. random rows: temperature, min_p, top_k, top_p, then sample with the Gumbel trick
   (probs / Exp(1) noise, argmax), each seeded row drawing its noise from its own generator so that
   its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qserve.engine.logits_processors import (
    TokenControls,
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    control_tensors,
)
from qserve.engine.sampling_params import SamplingParams, SamplingType

# How many of the most likely tokens top-p ranks before falling back to sorting the whole vocab.
TOP_P_CANDIDATES = 1024


def make_generator(
    params: SamplingParams, device: str | torch.device = "cpu"
) -> torch.Generator | None:
    """The generator of a RANDOM_SEED request (seeded from `params.seed`), else None.

    The model runner keeps one per request for the request's whole life: the generator's state
    advances with every step, so it must not be rebuilt each step.
    """
    if params.sampling_type != SamplingType.RANDOM_SEED:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(mix_seed(params.seed))
    return generator


def mix_seed(seed: int) -> int:
    """The 64-bit seed, every bit mixed into every other (splitmix64's finalizer). torch's CPU
    generator (mt19937) keeps only the low 32 bits of its seed, so seed 1 and seed 2**32 + 1 drew
    the same numbers; mixed, the high bits count too."""
    z = seed % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


@dataclass
class Logprobs:
    """One row's logprobs: the sampled token's own, its rank (1 = most likely), the top ones."""

    sampled_token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    # Per row; None for a row that asked for no logprobs. None when no row asked.
    logprobs: list[Logprobs | None] | None


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, built once from the rows' params.

    Tensors are [num_rows]; a processing tensor is None when no row uses that step.
    """

    temperature: Tensor | None  # fp32; 1.0 on greedy rows; None when all_greedy
    is_greedy: Tensor  # bool
    all_greedy: bool
    all_random: bool
    top_p: Tensor | None  # fp32
    top_k: Tensor | None  # int64, vocab_size where off
    min_p: Tensor | None  # fp32
    generators: dict[int, torch.Generator]  # row -> generator of a seeded random row
    presence_penalties: Tensor | None  # fp32; the three are None together (no_penalties)
    frequency_penalties: Tensor | None
    repetition_penalties: Tensor | None
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    min_tokens_stop_ids: dict[int, list[int]]  # row -> ids masked while below min_tokens
    num_logprobs: list[int | None]  # per row, params.logprobs
    max_num_logprobs: int | None  # None when no row asks for logprobs
    vocab_size: int
    # logits_processors.control_tensors: None when no row uses the control
    allowed_token_ids_mask: Tensor | None = None  # bool [num_rows, vocab], True: not allowed
    bad_words_banned: tuple[Tensor, Tensor] | None = None  # (rows, token ids) banned this step
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None  # (rows, token ids, biases)

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        token_controls: list[TokenControls | None] | None = None,
    ) -> SamplingMetadata:
        """`generators` maps row -> the request's generator (see `make_generator`), on `device`.
        `token_controls`: each row's, as the engine built them once per request (default: built
        from the params here, which needs no bad_words)."""
        if token_controls is None:
            token_controls = [TokenControls.build(p) for p in params]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            temperature=_to(_temperature(params, greedy), device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=_to(_float_or_none([p.top_p for p in params], off=1.0), device),
            top_k=_to(_top_k(params, vocab_size), device),
            min_p=_to(_float_or_none([p.min_p for p in params], off=0.0), device),
            generators={i: generators[i] for i in random_rows if i in generators},
            **{name: _to(t, device) for name, t in _penalties(params).items()},
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            min_tokens_stop_ids=_min_tokens_stop_ids(
                params, output_token_ids, eos_token_ids, vocab_size
            ),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
            vocab_size=vocab_size,
            **control_tensors(token_controls, output_token_ids, vocab_size, device),
        )


def _to(tensor: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if tensor is None else tensor.to(device)


def _temperature(params: list[SamplingParams], greedy: list[bool]) -> Tensor | None:
    if all(greedy):
        return None
    values = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    return torch.tensor(values, dtype=torch.float32)


def _float_or_none(values: list[float], off: float) -> Tensor | None:
    if all(v == off for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32)


def _top_k(params: list[SamplingParams], vocab_size: int) -> Tensor | None:
    values = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
    if all(v == vocab_size for v in values):
        return None
    return torch.tensor(values, dtype=torch.int64)


def _penalties(params: list[SamplingParams]) -> dict[str, Tensor | None]:
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    used = any(v != 0.0 for v in presence + frequency) or any(v != 1.0 for v in repetition)

    def column(values: list[float]) -> Tensor | None:
        return torch.tensor(values, dtype=torch.float32) if used else None

    return {
        "presence_penalties": column(presence),
        "frequency_penalties": column(frequency),
        "repetition_penalties": column(repetition),
    }


def _min_tokens_stop_ids(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: list[int],
    vocab_size: int,
) -> dict[int, list[int]]:
    rows = {}
    for i, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        stop_ids = p.all_stop_token_ids | (set() if p.ignore_eos else set(eos_token_ids))
        stop_ids = {t for t in stop_ids if t < vocab_size}
        if stop_ids:
            rows[i] = sorted(stop_ids)
    return rows


class Sampler:
    """Picks one token per row from fp32 logits [num_rows, vocab]."""

    def __call__(self, logits: Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.to(torch.float32)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()  # the steps below work in place
        apply_allowed_token_ids(logits, metadata.allowed_token_ids_mask)
        apply_bad_words(logits, metadata.bad_words_banned)
        apply_min_tokens(logits, metadata.min_tokens_stop_ids)
        apply_logit_bias(logits, metadata.logit_bias)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)

    def sample(self, logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        """Token ids [num_rows] from processed logits."""
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        logits = logits.div_(metadata.temperature.unsqueeze(1))
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        random = random_sample(logits.softmax(dim=-1), metadata.generators)
        if greedy is None:
            return random
        return torch.where(metadata.is_greedy, greedy, random)


def apply_min_tokens(logits: Tensor, stop_ids: dict[int, list[int]]) -> None:
    """Forbid stop / EOS ids on rows still below their min_tokens (in place)."""
    for row, ids in stop_ids.items():
        logits[row, ids] = -float("inf")


def token_bin_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> Tensor:
    """Occurrences of each token id per row: int64 [num_rows, vocab_size]."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Pad with vocab_size, an extra bin that is dropped.
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_ids]
    padded = torch.tensor(padded, dtype=torch.int64, device=device).view(len(token_ids), width)
    counts = torch.zeros((len(token_ids), vocab_size + 1), dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
    """Repetition (prompt + output), then frequency and presence (output only), as in vLLM."""
    vocab_size = logits.shape[1]
    output_counts = token_bin_counts(metadata.output_token_ids, vocab_size, logits.device)
    output_mask = output_counts > 0
    prompt_counts = token_bin_counts(metadata.prompt_token_ids, vocab_size, logits.device)
    seen = output_mask | (prompt_counts > 0)
    repetition = metadata.repetition_penalties.unsqueeze(1)
    factor = torch.where(seen, repetition, 1.0)  # [num_rows, vocab]
    # Divide positive logits, multiply negative ones: both move away from being picked.
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, -float("inf"))


def apply_top_k_top_p(logits: Tensor, k: Tensor | None, p: Tensor | None) -> Tensor:
    """Keep the k largest logits (ties kept), then the most likely tokens whose mass reaches p."""
    if k is not None:
        logits = apply_top_k(logits, k)
    if p is not None:
        logits = apply_top_p(logits, p)
    return logits


def apply_top_k(logits: Tensor, k: Tensor) -> Tensor:
    """Mask logits below each row's k-th largest (vLLM's top-k-only path: topk, not a sort)."""
    top_values = logits.topk(int(k.max()), dim=-1).values  # [num_rows, max_k], descending
    kth_value = top_values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill_(logits < kth_value, -float("inf"))


def apply_top_p(logits: Tensor, p: Tensor) -> Tensor:
    """Keep a token when the mass of the tokens ranked above it is below p (the top one always).

    Ranks come from a partial sort of the TOP_P_CANDIDATES most likely tokens; that is exact when
    those hold mass >= p on every row (then no other token can be kept), else all are sorted.
    """
    probs = logits.softmax(dim=-1)
    vocab_size = probs.shape[1]
    top_probs, top_ids = probs.topk(min(TOP_P_CANDIDATES, vocab_size), dim=-1)  # descending
    covered = (top_probs.sum(dim=-1) >= p) | (p >= 1.0)
    if top_probs.shape[1] < vocab_size and not bool(covered.all()):
        top_probs, top_ids = probs.sort(dim=-1, descending=True)
    mass_above = top_probs.cumsum(dim=-1) - top_probs  # [num_rows, num_candidates]
    keep = mass_above < p.unsqueeze(1)
    keep[:, 0] = True
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top_ids, keep)
    kept |= (p >= 1.0).unsqueeze(1)  # rows with top-p off keep everything
    return logits.masked_fill_(~kept, -float("inf"))


def random_sample(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """argmax(probs / q) with q ~ Exp(1): a draw from `probs` (the exponential race / Gumbel trick).

    q = -log(u), u ~ U[0, 1): the same law as `exponential_` (what vLLM draws) at a third of the
    cost on CPU; u = 0 gives q = inf and a score of 0, never NaN. Rows in `generators` draw u from
    their own generator, the others from the global RNG.
    """
    u = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    q = u.log_().neg_()
    return probs.div_(q).argmax(dim=-1)


def gather_logprobs(
    logprobs: Tensor, sampled: Tensor, num_logprobs: list[int | None]
) -> list[Logprobs | None]:
    """Per row: the sampled token's logprob and rank, and its top `num_logprobs` tokens."""
    max_k = max(n for n in num_logprobs if n is not None)
    top_values, top_ids = logprobs.topk(max_k, dim=-1)  # [num_rows, max_k], sorted
    sampled_values = logprobs.gather(1, sampled.unsqueeze(1))  # [num_rows, 1]
    # Rank as vLLM counts it: tokens at least as likely as the sampled one (itself included).
    ranks = (logprobs >= sampled_values).sum(dim=-1)
    rows = zip(
        num_logprobs,
        sampled.tolist(),
        sampled_values.squeeze(1).tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_values.tolist(),
        strict=True,
    )
    return [
        None if n is None else Logprobs(token, value, rank, ids[:n], values[:n])
        for n, token, value, rank, ids, values in rows
    ]
