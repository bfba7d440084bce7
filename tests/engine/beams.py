"""transformers' beam search as the reference of qserve's (`generate(num_beams=k)`), shared by
the unit tests on a tiny model and the SmolLM2 comparison."""

from __future__ import annotations

import torch

from qserve.engine.beam_search import BeamSearchParams


def transformers_beams(
    model, prompt: list[int], params: BeamSearchParams, eos: int, pad: int
) -> tuple[list[list[int]], list[float]]:
    """The k returned sequences (generated tokens, each ending at its first EOS: transformers
    pads shorter ones after it) and their scores, best first."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=eos,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_scores=True,
        )
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt) :]
        seqs.append(gen[: gen.index(eos) + 1] if eos in gen else gen)
    return seqs, out.sequences_scores.tolist()
