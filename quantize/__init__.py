"""Quantization algorithms, calibration driver and exporters. Installed as `qserve.quantize`.

    rtn.py          QuantizedWeight (codes, scales [G, N], zeros [G, N], g_idx [K]) and RTN
    gptq.py         accumulate_hessian, gptq_quantize, gptq_w8_quantize (int8/fp8 rounding)
    awq.py          activation_mean, search_scale, search_clip (AWQ search)
    smoothquant.py  smooth_scales, quantize_int8 (W8A8)
    fp8.py          quantize_fp8, fp8_input_scale (E4M3)
    fold.py         folding scales into norms / previous linears; ScaleResult (save, replay)
    arch.py         per-architecture tables: sequential groups and scale mappings
    export.py       GPTQ / AWQ / compressed-tensors tensors and configs; atomic folder writes
    kv_scales.py    FP8 KV cache k_scale / v_scale from calibration (KVObserver)
    calibration.py  calibration text (.txt, .jsonl, bundled Moby-Dick) and token windows
    driver.py       quantize_model: one decoder block at a time, then export

Importing this package imports nothing heavy; import the submodules you need.
"""
