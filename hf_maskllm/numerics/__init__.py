"""The numerics mask learning is built on, shared by the mask adapters and the optimizer.

- ``sampling.py``: the Gumbel-softmax sample of N:M candidates, its counter-based noise and the hard choice;
- ``denormals.py``: values below the float32 normal range are flushed to zero wherever they would arise;
- ``fused_linear.py``: the training forward and backward of a masked linear, with the sampling fused in.

Nothing here knows about models, layers or files: ``adapters/`` and ``optim.py`` build on it.
"""
