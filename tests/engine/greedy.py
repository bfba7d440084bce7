"""Greedy generation on both sides, for the tests that compare the engine with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qserve.engine.llm import LLM
from qserve.engine.sampling_params import SamplingParams


def transformers_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """transformers `generate`'s greedy continuation of each prompt, exactly `max_tokens` long.
    The attention mask is explicit: a prompt token equal to the pad id is not padding."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(seq[0, len(p) :].tolist())
    return outs


def engine_greedy(
    model_dir: Path | str, prompts: list[list[int]], max_tokens: int, **engine_args: Any
) -> tuple[LLM, list[list[int]]]:
    """The engine (fp32) and its greedy continuation of each prompt, `max_tokens` long."""
    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return llm, [o.outputs[0].token_ids for o in outputs]
