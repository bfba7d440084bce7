"""Tensor and pipeline parallelism (issue 24): weight shards so far (`shard`)."""
