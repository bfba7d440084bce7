"""Kernels: Triton GPU kernels and their pure-torch references (the CPU path).

Installed as `qserve.kernels`. Imports only torch (and triton, lazily).
"""
