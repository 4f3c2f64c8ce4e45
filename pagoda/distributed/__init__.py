"""Tensor parallelism: the ranks' process groups and collectives (`group`), and how a model
built for one rank is sharded and loaded (`sharding`). The processes themselves are started by
`pagoda.worker.tp_executor`; nothing here knows about requests or scheduling.
"""
