"""Quantization algorithms, calibration driver and exporters. Installed as `qserve.quantize`."""
