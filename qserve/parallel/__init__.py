"""Tensor and pipeline parallelism (issue 24): weight shards (`shard`), a tensor-parallel
rank's model (`tensor_parallel`), a pipeline stage's model (`pipeline_parallel`) and the worker
processes that run ranks 1.. (`workers`)."""
