"""Tensor and pipeline parallelism (issue 24): weight shards (`shard`) and a tensor-parallel
rank's model (`tensor_parallel`); no worker processes yet."""
