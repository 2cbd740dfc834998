"""Server shard: store, optimizers, aggregation, consistency, membership, checkpoint, servicer."""
