"""workers.kernels: values against plain references, gradients against finite
differences (float64), duplicate rows summed, errors; fused CuPy vs NumPy on a GPU."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qps import backend
from workers import kernels as K
from workers.fused import SOFTMAX_XENT_SRC


def numgrad(f, x, eps=1e-6):
    """Central differences of the scalar f() with respect to every element of x."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        hi = f()
        flat[i] = old - eps
        lo = f()
        flat[i] = old
        gflat[i] = (hi - lo) / (2 * eps)
    return g


def test_importing_workers_never_imports_cupy():
    code = (
        "import sys, workers, workers.kernels, workers.models, workers.data\n"
        "assert 'cupy' not in sys.modules, 'cupy was imported'\n"
        "assert 'sklearn' not in sys.modules, 'sklearn was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ softmax x-entropy


def test_softmax_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((7, 5))
    y = rng.integers(0, 5, 7)
    loss, g = K.softmax_cross_entropy(z, y)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    assert loss == pytest.approx(-np.log(p[np.arange(7), y]).mean(), rel=1e-12)
    fd = numgrad(lambda: K.softmax_cross_entropy(z, y, with_grad=False)[0], z)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g.sum(axis=1), 0, atol=1e-12)  # softmax - onehot sums to 0


def test_softmax_cross_entropy_is_stable_and_keeps_dtype():
    z = np.array([[1e4, 0.0, -1e4], [-3e4, -3e4, -3e4]], np.float32)
    y = np.array([1, 2])
    loss, g = K.softmax_cross_entropy(z, y)
    assert np.isfinite(loss) and np.isfinite(g).all()
    assert loss == pytest.approx((1e4 + np.log(3)) / 2, rel=1e-6)
    assert g.dtype == np.float32
    assert K.softmax_cross_entropy(z, y, with_grad=False)[1] is None
    assert K.softmax_cross_entropy(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))[0] == 0.0


def test_softmax_cross_entropy_errors():
    z = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"labels\[1\] = 3 is not in \[0, 3\)"):
        K.softmax_cross_entropy(z, np.array([0, 3]))
    with pytest.raises(ValueError, match="labels must have shape"):
        K.softmax_cross_entropy(z, np.array([0, 1, 2]))
    with pytest.raises(TypeError, match="labels must be integers"):
        K.softmax_cross_entropy(z, np.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="logits must be a floating"):
        K.softmax_cross_entropy(np.zeros((2, 3), np.int64), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"logits must be \[N, C\]"):
        K.softmax_cross_entropy(np.zeros(3, np.float32), np.array([0, 1, 2]))


def test_softmax_and_log_softmax():
    z = np.array([[1000.0, 1000.0], [0.0, np.log(3.0)]])
    np.testing.assert_allclose(K.softmax(z), [[0.5, 0.5], [0.25, 0.75]])
    np.testing.assert_allclose(K.log_softmax(z), np.log([[0.5, 0.5], [0.25, 0.75]]))


# ------------------------------------------------------------------ sigmoid x-entropy


def test_sigmoid_cross_entropy_value_gradient_and_stability():
    rng = np.random.default_rng(1)
    z = rng.standard_normal(9) * 3
    y = rng.integers(0, 2, 9)
    loss, g = K.sigmoid_cross_entropy(z, y)
    p = 1 / (1 + np.exp(-z))
    assert loss == pytest.approx(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean(), rel=1e-12)
    fd = numgrad(lambda: K.sigmoid_cross_entropy(z, y)[0], z)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
    big = np.array([[800.0], [-800.0]], np.float32)
    loss, g = K.sigmoid_cross_entropy(big, np.array([0, 1]))
    assert loss == pytest.approx(800.0) and g.shape == (2, 1) and np.isfinite(g).all()
    with pytest.raises(ValueError, match="labels must have shape"):
        K.sigmoid_cross_entropy(z, y[:3])


# ------------------------------------------------------------------------------- ReLU


def test_relu_forward_and_backward():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 6))
    x[np.abs(x) < 1e-3] = 0.5  # keep finite differences away from the kink
    b = rng.standard_normal(6)
    r = rng.standard_normal((4, 6))
    np.testing.assert_array_equal(K.relu(x), np.where(x > 0, x, 0))
    out = K.bias_relu(x, b)
    np.testing.assert_array_equal(out, np.maximum(x + b, 0))
    shifted = x + b
    shifted[np.abs(shifted) < 1e-3] = 0.5
    out = K.relu(shifted)
    g = K.relu_backward(r, out)
    fd = numgrad(lambda: float((K.relu(shifted) * r).sum()), shifted)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
    assert K.relu(x.astype(np.float32)).dtype == np.float32
    # a poisoned gradient is never hidden, even where the unit was off
    assert np.isnan(K.relu_backward(np.array([np.nan, 1.0]), np.array([0.0, 0.0]))).tolist() == [
        True,
        False,
    ]


# ------------------------------------------------------------------------- embeddings


def bag_reference(table, bags, mode):
    out = np.zeros((len(bags), table.shape[1]))
    for b, bag in enumerate(bags):
        bag = [i for i in bag if i >= 0]
        if bag:
            s = table[bag].sum(axis=0)
            out[b] = s / len(bag) if mode == "mean" else s
    return out


def test_gather_rows():
    table = np.arange(12.0).reshape(6, 2)
    ids = np.array([[5, 0], [0, 0]])
    np.testing.assert_array_equal(K.gather_rows(table, ids), table[ids])
    with pytest.raises(IndexError, match=r"ids\[1\] = 6 is not in \[0, 6\)"):
        K.gather_rows(table, np.array([1, 6]))
    with pytest.raises(IndexError, match=r"ids\[0\] = -1"):
        K.gather_rows(table, np.array([-1]))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_fixed_width_with_padding(mode):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((10, 3))
    ids = np.array([[1, 1, 4], [2, -1, -1], [-1, -1, -1], [9, 0, 9]])
    out = K.embedding_bag(table, ids, mode=mode)
    np.testing.assert_allclose(out, bag_reference(table, ids.tolist(), mode))
    assert out.shape == (4, 3)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_offsets_equals_fixed_width(mode):
    rng = np.random.default_rng(4)
    table = rng.standard_normal((8, 2))
    flat = np.array([3, 3, 7, 1, 0, 5])
    offsets = np.array([0, 3, 3, 4])  # bags [3,3,7], [], [1], [0,5]
    out = K.embedding_bag(table, flat, offsets, mode=mode)
    bags = [[3, 3, 7], [], [1], [0, 5]]
    np.testing.assert_allclose(out, bag_reference(table, bags, mode))
    padded = np.array([[3, 3, 7], [-1, -1, -1], [1, -1, -1], [0, 5, -1]])
    np.testing.assert_allclose(out, K.embedding_bag(table, padded, mode=mode))


def dense_from_sparse(rows, values, shape):
    g = np.zeros(shape)
    g[rows] = values
    return g


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("form", ["fixed", "offsets"])
def test_embedding_bag_backward_matches_finite_differences(mode, form):
    rng = np.random.default_rng(5)
    table = rng.standard_normal((9, 4))
    r = rng.standard_normal((5, 4))
    if form == "fixed":
        ids, offsets = np.array([[2, 2, 8], [0, -1, -1], [-1, -1, -1], [8, 3, 2], [5, 5, 5]]), None
    else:
        ids, offsets = np.array([2, 2, 8, 0, 8, 3, 2, 5, 5, 5]), np.array([0, 3, 4, 4, 7])

    def f():
        return float((K.embedding_bag(table, ids, offsets, mode=mode) * r).sum())

    rows, values = K.embedding_bag_backward(r, ids, offsets, mode=mode)
    assert rows.dtype == np.int64
    assert rows.tolist() == [0, 2, 3, 5, 8]  # distinct, sorted, no padding
    np.testing.assert_allclose(
        dense_from_sparse(rows, values, table.shape), numgrad(f, table), rtol=1e-6, atol=1e-9
    )


def test_embedding_bag_errors():
    table = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match=r"ids\[2\] = 4 is not in \[0, 4\) \(-1 pads a bag\)"):
        K.embedding_bag(table, np.array([[0, 1], [4, 0]]))
    with pytest.raises(IndexError, match=r"= -2"):
        K.embedding_bag(table, np.array([[0, -2]]))
    with pytest.raises(IndexError, match=r"= -1 is not in"):  # no padding with offsets
        K.embedding_bag(table, np.array([0, -1]), np.array([0]))
    with pytest.raises(ValueError, match="mode must be one of sum, mean"):
        K.embedding_bag(table, np.array([[0]]), mode="max")
    with pytest.raises(ValueError, match="offsets must start at 0"):
        K.embedding_bag(table, np.array([0, 1]), np.array([1]))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        K.embedding_bag(table, np.array([0, 1]), np.array([0, 2, 1]))
    with pytest.raises(ValueError, match=r"ids must be \[B, L\]"):
        K.embedding_bag(table, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"grad must be \[2, dim\]"):
        K.embedding_bag_backward(np.zeros((3, 2)), np.array([[0], [1]]))
    with pytest.raises(ValueError, match="embedding table must be"):
        K.embedding_bag(np.zeros(4), np.array([[0]]))


# ------------------------------------------------------------------------ scatter-add


def test_scatter_add_rows_sums_duplicates_and_sorts():
    ids = np.array([7, 2, 7, 7, 0, 2])
    vals = np.arange(12.0).reshape(6, 2)
    rows, summed = K.scatter_add_rows(ids, vals)
    assert rows.tolist() == [0, 2, 7]
    np.testing.assert_array_equal(summed, [[8, 9], [2 + 10, 3 + 11], [0 + 4 + 6, 1 + 5 + 7]])
    rows, summed = K.scatter_add_rows(np.array([3, 1]), vals[:2])  # no repeats
    assert rows.tolist() == [1, 3]
    np.testing.assert_array_equal(summed, [[2, 3], [0, 1]])
    rows, summed = K.scatter_add_rows(np.zeros(0, np.int64), np.zeros((0, 2)))
    assert rows.shape == (0,) and summed.shape == (0, 2)
    with pytest.raises(ValueError, match=r"ids must be \[n\] and values \[n, ...\]"):
        K.scatter_add_rows(ids, vals[:5])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=0, max_size=40),
    st.integers(1, 3),
)
def test_scatter_add_rows_property(ids, dim):
    ids = np.array(ids, np.int64)
    vals = np.random.default_rng(len(ids)).standard_normal((len(ids), dim))
    rows, summed = K.scatter_add_rows(ids, vals)
    assert rows.tolist() == sorted(set(ids.tolist()))
    ref = np.zeros((21, dim))
    np.add.at(ref, ids, vals)
    np.testing.assert_allclose(summed, ref[rows], atol=1e-12)


# -------------------------------------------------------------------------------- GPU

needs_gpu = pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")


def test_softmax_kernel_source_compiles_with_nvrtc():
    """The raw CUDA source compiles (NVRTC needs no device); skipped without CuPy's NVRTC."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception as exc:  # CuPy without a loadable libnvrtc
        pytest.skip(f"NVRTC is not available: {exc}")
    try:  # the oldest architecture this NVRTC builds for (CUDA 13 dropped compute_70)
        arch = min(int(a) for a in nvrtc.getSupportedArchs())
    except Exception:  # a CuPy without the call: 7.5 is built by CUDA 11 to 13
        arch = 75
    prog = nvrtc.createProgram(SOFTMAX_XENT_SRC, "qps_softmax_xent.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{arch}"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
    assert nvrtc.getPTX(prog)


@pytest.fixture(params=[True, False], ids=["fused", "plain"])
def cupy_mode(request, monkeypatch):
    import cupy as cp

    monkeypatch.setattr(K, "use_fused_kernels", request.param)
    return cp


TOL = {"rtol": 2e-5, "atol": 2e-6}


@pytest.mark.gpu
@needs_gpu
def test_gpu_softmax_cross_entropy_twin(cupy_mode):
    cp = cupy_mode
    rng = np.random.default_rng(10)
    z = (rng.standard_normal((300, 10)) * 5).astype(np.float32)
    z[0, 0] = 80.0
    y = rng.integers(0, 10, 300)
    loss_h, g_h = K.softmax_cross_entropy(z, y)
    loss_d, g_d = K.softmax_cross_entropy(cp.asarray(z), cp.asarray(y))
    assert backend.is_cupy_array(g_d)
    assert loss_d == pytest.approx(loss_h, rel=1e-5)
    np.testing.assert_allclose(cp.asnumpy(g_d), g_h, **TOL)
    assert K.softmax_cross_entropy(cp.asarray(z), cp.asarray(y), with_grad=False)[
        0
    ] == pytest.approx(loss_h, rel=1e-5)
    with pytest.raises(ValueError, match="is not in"):
        K.softmax_cross_entropy(cp.asarray(z), cp.asarray(y + 10))


@pytest.mark.gpu
@needs_gpu
def test_gpu_sigmoid_relu_twins(cupy_mode):
    cp = cupy_mode
    rng = np.random.default_rng(11)
    z = (rng.standard_normal(257) * 10).astype(np.float32)
    y = rng.integers(0, 2, 257)
    loss_h, g_h = K.sigmoid_cross_entropy(z, y)
    loss_d, g_d = K.sigmoid_cross_entropy(cp.asarray(z), cp.asarray(y))
    assert loss_d == pytest.approx(loss_h, rel=1e-5)
    np.testing.assert_allclose(cp.asnumpy(g_d), g_h, **TOL)
    x = rng.standard_normal((33, 17)).astype(np.float32)
    b = rng.standard_normal(17).astype(np.float32)
    r = rng.standard_normal((33, 17)).astype(np.float32)
    xd, bd, rd = cp.asarray(x), cp.asarray(b), cp.asarray(r)
    np.testing.assert_array_equal(cp.asnumpy(K.relu(xd)), K.relu(x))
    np.testing.assert_allclose(cp.asnumpy(K.bias_relu(xd, bd)), K.bias_relu(x, b), **TOL)
    out = K.relu(x)
    np.testing.assert_array_equal(
        cp.asnumpy(K.relu_backward(rd, cp.asarray(out))), K.relu_backward(r, out)
    )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_gpu_embedding_twins(cupy_mode, mode):
    cp = cupy_mode
    rng = np.random.default_rng(12)
    table = rng.standard_normal((50, 16)).astype(np.float32)
    ids = rng.integers(-1, 50, (64, 5))
    ids[3] = -1  # an empty bag
    grad = rng.standard_normal((64, 16)).astype(np.float32)
    td, idd, gd = cp.asarray(table), cp.asarray(ids), cp.asarray(grad)
    np.testing.assert_allclose(
        cp.asnumpy(K.embedding_bag(td, idd, mode=mode)),
        K.embedding_bag(table, ids, mode=mode),
        **TOL,
    )
    rows_h, vals_h = K.embedding_bag_backward(grad, ids, mode=mode)
    rows_d, vals_d = K.embedding_bag_backward(gd, idd, mode=mode)
    np.testing.assert_array_equal(cp.asnumpy(rows_d), rows_h)
    np.testing.assert_allclose(cp.asnumpy(vals_d), vals_h, **TOL)
    # the offsets form
    flat = rng.integers(0, 50, 200)
    offsets = np.sort(rng.integers(0, 200, 40))
    offsets[0] = 0
    od, fd = cp.asarray(offsets), cp.asarray(flat)
    np.testing.assert_allclose(
        cp.asnumpy(K.embedding_bag(td, fd, od, mode=mode)),
        K.embedding_bag(table, flat, offsets, mode=mode),
        **TOL,
    )
    g40 = grad[:40]
    rows_h, vals_h = K.embedding_bag_backward(g40, flat, offsets, mode=mode)
    rows_d, vals_d = K.embedding_bag_backward(cp.asarray(g40), fd, od, mode=mode)
    np.testing.assert_array_equal(cp.asnumpy(rows_d), rows_h)
    np.testing.assert_allclose(cp.asnumpy(vals_d), vals_h, **TOL)
    # gather and scatter-add
    np.testing.assert_array_equal(cp.asnumpy(K.gather_rows(td, cp.asarray(flat))), table[flat])
    vals = rng.standard_normal((200, 16)).astype(np.float32)
    rows_h, sum_h = K.scatter_add_rows(flat, vals)
    rows_d, sum_d = K.scatter_add_rows(fd, cp.asarray(vals))
    np.testing.assert_array_equal(cp.asnumpy(rows_d), rows_h)
    np.testing.assert_allclose(cp.asnumpy(sum_d), sum_h, **TOL)
