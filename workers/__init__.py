"""The worker role: training loop, models and NumPy/CuPy kernels.

The role itself (``qps worker``) arrives with the training work; today the queues in
:mod:`qps` are what workers will consume input batches from and push gradients through.
"""
