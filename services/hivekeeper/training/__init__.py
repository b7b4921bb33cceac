"""What the kinds that train (Swarm, ExpertPool) share: the local optimizer from the spec, the
order of batches, throughput windows and the report cadence of a training loop, and atomic
checkpoints."""
