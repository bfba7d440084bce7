"""Kernels: Triton GPU kernels and their pure-torch references (the CPU path).

Installed as `qserve.kernels`. Imports only torch (and triton, lazily). Model code calls `ops`,
which picks the Triton launcher for CUDA tensors and the torch reference otherwise.

    packing          bit packing of the GPTQ / AWQ formats (the one module that owns it)
    w4a16, w4a16_ref         GPTQ (4/8 bit, act-order) and AWQ GEMMs
    scaled_mm                shared Triton activation quantization (int8, fp8) and scaled GEMM
                             (int8 x int8, fp8 x fp8, fp16/bf16 x int8); tile launch helpers
    int8, int8_ref           per-token int8 quantization, W8A8 int8, W8A16
    fp8, fp8_ref             FP8 (e4m3) activation quantization and W8A8 FP8
    paged_attention, cache_write, attention_ref    paged KV cache read / write (sliding windows)
    fused_moe, fused_moe_ref grouped GEMM over tokens sorted by expert (dense, GPTQ, W8 experts;
                             not yet run on a GPU) and moe_align_block_size
    cpu_weight_only          torch's CPU int4/int8 weight-only kernels fed our formats
    ops                      dispatch
"""
