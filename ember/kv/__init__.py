"""The KV connector: the one seam through which KV blocks leave or enter an engine.

`connector.py` has its two halves (the scheduler's and the worker's), `server.py` the
endpoint a prefill worker serves its finished prompts' blocks from, `transport.py` the
ways blocks move (TCP straight into block buffers, shared memory, a fault-injecting
fake), `buffers.py` how an engine's KV tensors are laid out as blocks, `params.py` what
the frontends and the router pass along.
"""
