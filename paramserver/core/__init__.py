"""The pure core of a server shard: store, update rules, aggregation, consistency, the shard state
machine, key placement, embedding tables and push-sum. Synchronous, no I/O, no asyncio.
"""
