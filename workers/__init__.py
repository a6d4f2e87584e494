"""The worker role: training loop, models and NumPy/CuPy kernels.

* :mod:`workers.models` — the :class:`~workers.models.Model` protocol (parameter specs,
  ``init_params``, ``loss_and_grads``, ``rows_needed``, ``predict``/``accuracy``), the
  built-in models (softmax regression, MLP, embedding-bag + MLP) and
  :func:`~workers.models.build_model` for ``--model`` spec strings.
* :mod:`workers.kernels` — softmax/sigmoid cross-entropy, ReLU, embedding gather and
  scatter-add, in NumPy's API with fused CuPy kernels for float32 device arrays.
* :mod:`workers.data` — the benchmark data sets (W4 digits, W5 teacher), synthetic CTR
  data, ``.npz``/``.npy`` loading and W4's minibatch order.

Models and kernels compute with the module of the arrays they are given (NumPy or CuPy,
see :mod:`qps.backend`); importing this package never imports CuPy. ``docs/models.md``
describes the protocol and how to plug in a model of your own.
"""
