"""Tensor and pipeline parallelism (issue 24): weight shards (`shard`), a tensor-parallel
rank's model (`tensor_parallel`) and the worker processes that run ranks 1.. (`workers`).
Pipeline parallelism is not built."""
