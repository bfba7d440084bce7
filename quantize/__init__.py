"""Quantization algorithms, calibration driver and exporters. Installed as `qserve.quantize`.

    rtn.py          QuantizedWeight (codes, scales [G, N], zeros [G, N], g_idx [K]) and RTN
    gptq.py         accumulate_hessian, gptq_quantize, gptq_w8_quantize (int8/fp8 rounding)
    awq.py          activation_mean, search_scale, search_clip (AWQ search)
    smoothquant.py  smooth_scales, quantize_int8 (W8A8)
    fp8.py          quantize_fp8, fp8_input_scale (E4M3)
    fold.py         folding scales into norms / previous linears; ScaleResult (save, replay)
    arch.py         per-architecture tables: sequential groups and scale mappings (MoE: per expert)
    moe.py          mixture-of-experts blocks for calibration: per-expert linears, routed tokens
    kv_scales.py    FP8 KV cache k_scale / v_scale from calibration (KVObserver)
    calibration.py  calibration text (.txt, .jsonl, bundled Moby-Dick) and token windows

    settings.py     QuantizeSettings (every quantize option, checked once), group-size rules
    driver.py       quantize_model: one decoder block at a time, then export
    capture.py      forward hooks: block 0's inputs, a block's linear inputs into accumulators
    block_context.py  one block with its calibration inputs; GPTAQ's float reference
    methods.py      the per-block quantizer of each method (one protocol), lm_head
    results.py      W8Weight, BlockResults (what a block's quantization gives back)
    offload.py      blocks on disk during calibration (BlockOffload)
    export.py       method -> format: tensors, quantization_config, the checkpoint folder
    safetensors_merge.py  one safetensors file from memory + files, one tensor at a time
    output_dir.py   output folder rules, staging folder and atomic swap
    model_check.py  the model's tensors against its config, before any work

Importing this package imports nothing heavy; import the submodules you need.
"""
