"""transformers and gptqmodel on mixture-of-experts models, in a process of their own:

    python -m tests.quantize.transformers_moe_logits logits OUT PROMPT FOLDER...
        saves transformers' {folder: {"logits": [len, vocab] fp32, "packed": names of packed
        linears}} for the GPTQ/AWQ checkpoints in FOLDER... to OUT
    python -m tests.quantize.transformers_moe_logits gptqmodel BASE OUT
        GPTQ (w4 g32, symmetric) of the model in BASE with gptqmodel, written to OUT

transformers 5 holds a MoE block's experts as fused 3-D parameters, which its GPTQ and AWQ
loaders cannot replace with packed per-expert linears; gptqmodel loads MoE checkpoints by first
patching transformers' MoE block classes back to per-expert linears with its `defuser`
package. That patch is process-wide, hence this script, so that the tests that compare against
stock transformers run unpatched.

Mixtral: our export keeps the names vLLM and the Hub's Mixtral checkpoints use
(`block_sparse_moe.experts.N.w1|w3|w2`); defuser's Mixtral names them
`mlp.experts.N.gate_proj|up_proj|down_proj` and renames only dense `.weight` tensors, so the
same renaming is given here for the packed tensors (`key_mapping`) and for the config's
`modules_in_block_to_quantize`. Qwen3-MoE's names are the same on both sides.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

MIXTRAL_KEYS = {
    r"block_sparse_moe\.experts\.(\d+)\.w1": r"mlp.experts.\1.gate_proj",
    r"block_sparse_moe\.experts\.(\d+)\.w2": r"mlp.experts.\1.down_proj",
    r"block_sparse_moe\.experts\.(\d+)\.w3": r"mlp.experts.\1.up_proj",
}


def rename(name: str, mapping: dict[str, str]) -> str:
    for pattern, replacement in mapping.items():
        name = re.sub(pattern, replacement, name)
    return name


def load(folder: Path) -> torch.nn.Module:
    import defuser
    from transformers import AutoConfig, AutoModelForCausalLM, AwqConfig, GPTQConfig

    config = AutoConfig.from_pretrained(folder)
    defuser.replace_fused_blocks(config.model_type)
    mapping = MIXTRAL_KEYS if config.model_type == "mixtral" else {}
    quant = config.quantization_config
    if quant.get("modules_in_block_to_quantize"):
        groups = quant["modules_in_block_to_quantize"]
        quant["modules_in_block_to_quantize"] = [[rename(n, mapping) for n in g] for g in groups]
    method = quant["quant_method"]
    loading = GPTQConfig(bits=4, backend="torch") if method == "gptq" else None
    loading = loading or AwqConfig(bits=4, backend="torch_awq")
    return AutoModelForCausalLM.from_pretrained(
        folder,
        config=config,
        dtype=torch.float32,
        quantization_config=loading,
        key_mapping=mapping or None,
    ).eval()


def logits(out: str, prompt: str, *folders: str) -> None:
    from benchmarks import third_party

    third_party.import_gptqmodel()
    ids = torch.tensor([[int(t) for t in prompt.split(",")]])
    results = {}
    for folder in folders:
        model = load(Path(folder))
        packed = [n for n, m in model.named_modules() if hasattr(m, "qweight")]
        with torch.inference_mode():
            logits = model(ids).logits[0].float()
        results[folder] = {"logits": logits, "packed": packed}
    torch.save(results, out)


def gptqmodel(base: str, out: str) -> None:
    from transformers import AutoTokenizer

    from benchmarks import third_party
    from qserve.quantize.calibration import calibration_windows, load_calibration_text

    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = calibration_windows(tokenizer, load_calibration_text(), num_samples=4, seq_len=64)
    with third_party.quiet():
        third_party.gptqmodel_quantize(base, out, ids, group_size=32)


if __name__ == "__main__":
    {"logits": logits, "gptqmodel": gptqmodel}[sys.argv[1]](*sys.argv[2:])
