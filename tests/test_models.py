"""workers.models and workers.data: specs and init, gradients against finite differences
(float64), sparse rows, W4's MLP trained by plain SGD, spec strings, the user-model
example of docs/models.md, the data helpers; CuPy vs NumPy on a GPU."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from qps import backend
from qps.errors import InvalidArgumentError
from qps.ps.messages import SparseGradient, check_gradient
from qps.varspec import VariableSpec
from workers import data
from workers.models import (
    MLP,
    BaseModel,
    EmbeddingBagMLP,
    Model,
    Rows,
    SoftmaxRegression,
    build_model,
    check_params,
    grads_to_host,
    model_names,
    params_to,
    register_model,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def as64(params):
    return {
        k: (
            Rows(v.indices, v.values.astype(np.float64))
            if isinstance(v, Rows)
            else v.astype(np.float64)
        )
        for k, v in params.items()
    }


def dense_grad(g, shape):
    if isinstance(g, SparseGradient):
        out = np.zeros(shape)
        np.add.at(out, g.indices, g.values)
        return out
    return g


def check_gradients(model, params, batch, tol=1e-6, eps=1e-6):
    """Every gradient of model.loss_and_grads against central differences of its loss."""
    loss, grads = model.loss_and_grads(params, batch)
    assert set(grads) == {p.name for p in model.params_spec()}
    for p in model.params_spec():
        value = params[p.name]
        arr = value.values if isinstance(value, Rows) else value
        g = grads[p.name]
        if isinstance(value, Rows):  # a gradient of rows: map the pulled rows back
            assert isinstance(g, SparseGradient)
            got = dense_grad(g, p.shape)[value.indices]
        else:
            got = dense_grad(g, arr.shape)
        fd = np.zeros_like(arr)
        flat, fdf = arr.reshape(-1), fd.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + eps
            hi = model.loss(params, batch)
            flat[i] = old - eps
            lo = model.loss(params, batch)
            flat[i] = old
            fdf[i] = (hi - lo) / (2 * eps)
        np.testing.assert_allclose(got, fd, rtol=tol, atol=1e-8, err_msg=p.name)
    return loss, grads


# ----------------------------------------------------------------------- dense models


def test_mlp_w4_spec_and_init_is_w4s():
    m = MLP([64, 128, 10])
    specs = m.params_spec()
    assert [(p.name, p.shape, p.dtype, p.sparse) for p in specs] == [
        ("W1", (64, 128), np.float32, False),
        ("b1", (128,), np.float32, False),
        ("W2", (128, 10), np.float32, False),
        ("b2", (10,), np.float32, False),
    ]
    params = m.init_params(np.random.default_rng(0))
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 128), np.float32) * np.sqrt(2 / 64)
    w2 = rng.standard_normal((128, 10), np.float32) * np.sqrt(2 / 128)
    np.testing.assert_array_equal(params["W1"], w1.astype(np.float32))
    np.testing.assert_array_equal(params["W2"], w2.astype(np.float32))
    assert params["W1"].dtype == np.float32
    assert not params["b1"].any() and not params["b2"].any()
    assert m.spec == "mlp:64,128,10"
    assert isinstance(m, Model)


def test_mlp_w5_has_w5s_size():
    m = build_model("mlp:784,1024,1024,10")
    assert m.num_params == 1_863_690
    assert m.num_params * 4 == 7_454_760


@pytest.mark.parametrize("widths", [[5, 3], [4, 6, 5, 3]])
def test_dense_model_gradients(widths):
    m = SoftmaxRegression(*widths) if len(widths) == 2 else MLP(widths)
    params = as64(m.init_params(np.random.default_rng(1)))
    rng = np.random.default_rng(2)
    for k in params:
        if k.startswith("b"):
            params[k] += rng.standard_normal(params[k].shape) * 0.1
    x = rng.standard_normal((8, widths[0]))
    y = rng.integers(0, widths[-1], 8)
    loss, grads = check_gradients(m, params, (x, y))
    assert loss == pytest.approx(m.loss(params, (x, y)))
    assert all(grads[k].shape == params[k].shape for k in params)


def test_dense_model_predict_accuracy_and_errors():
    m = SoftmaxRegression(2, 3)
    params = {"W1": np.array([[1.0, 0, 0], [0, 1.0, 0]]), "b1": np.array([0, 0, 0.5])}
    x = np.array([[2.0, 0], [0, 2.0], [0, 0]])
    y = np.array([0, 1, 1])
    assert m.predict(params, (x, y)).tolist() == [0, 1, 2]
    assert m.accuracy(params, (x, y)) == pytest.approx(2 / 3)
    with pytest.raises(InvalidArgumentError, match=r"x must be \[N, 2\], got \[3, 3\]"):
        m.loss_and_grads(params, (np.zeros((3, 3)), y))
    with pytest.raises(InvalidArgumentError, match=r"a batch of this model is \(x, y\)"):
        m.loss_and_grads(params, (x,))
    with pytest.raises(InvalidArgumentError, match="classes and must be >= 2"):
        MLP([4, 1])
    with pytest.raises(InvalidArgumentError, match="at least 2 widths"):
        MLP([4])
    with pytest.raises(InvalidArgumentError, match="every width must be an int >= 1"):
        MLP([4, 0, 3])
    check_params(m, params)
    with pytest.raises(InvalidArgumentError, match="params has no 'b1'"):
        check_params(m, {"W1": params["W1"]})
    with pytest.raises(
        InvalidArgumentError, match=r"'W1' has shape \[3, 2\], the model needs \[2, 3\]"
    ):
        check_params(m, {"W1": params["W1"].T, "b1": params["b1"]})


def test_w4_mlp_sgd_on_digits_reaches_095():
    d = data.load_digits()
    assert (d.x_train.shape, d.x_test.shape) == ((1437, 64), (360, 64))
    m = build_model("mlp:64,128,10")
    params = m.init_params(np.random.default_rng(0))
    batches = data.minibatches(len(d.y_train), 64, np.random.default_rng(1))
    for _ in range(1500):
        _, grads = m.loss_and_grads(params, data.take((d.x_train, d.y_train), next(batches)))
        for k, g in grads.items():
            params[k] -= np.float32(0.05) * g
    assert all(v.dtype == np.float32 for v in params.values())
    acc = m.accuracy(params, (d.x_test, d.y_test))
    assert acc >= 0.95, acc


# ------------------------------------------------------------------------ sparse model


def ctr_batch(model, n=6, seed=3):
    dense, ids, y = data.synthetic_ctr(
        n, model.vocab, bag=3, dense=model.n_dense, classes=model.classes, seed=seed, ragged=True
    )
    ids[0, 0] = [1, 1, 1]  # a repeated id within a bag
    ids[1, 0] = [1, -1, -1]  # ... and across examples
    return dense.astype(np.float64), ids, y


@pytest.mark.parametrize("pool", ["sum", "mean"])
@pytest.mark.parametrize("classes", [1, 3])
def test_embbag_gradients(pool, classes):
    m = EmbeddingBagMLP([7, 5], 3, dense=2, hidden=[4], classes=classes, pool=pool)
    params = as64(m.init_params(np.random.default_rng(0)))
    batch = ctr_batch(m)
    _, grads = check_gradients(m, params, batch)
    for name in m.tables:
        g = grads[name]
        assert isinstance(g, SparseGradient) and g.indices.dtype == np.int64
        assert g.indices.tolist() == sorted(set(g.indices.tolist()))
        assert g.values.shape == (len(g.indices), 3)
    assert set(grads["emb0"].indices.tolist()) == set(m.rows_needed(batch)["emb0"].tolist())


def test_embbag_rows_needed_and_pulled_rows_give_the_same_gradients():
    m = EmbeddingBagMLP([50, 40, 30], 4, dense=3, hidden=[8, 6], pool="mean")
    full = as64(m.init_params(np.random.default_rng(0)))
    batch = ctr_batch(m, n=10)
    needed = m.rows_needed(batch)
    assert set(needed) == {"emb0", "emb1", "emb2"}
    for f, name in enumerate(m.tables):
        ids = batch[1][:, f, :]
        assert needed[name].tolist() == sorted(set(ids[ids >= 0].tolist()))
    pulled = dict(full)
    pulled.update({n: Rows(r, full[n][r]) for n, r in needed.items()})
    check_params(m, pulled)
    loss_full, g_full = m.loss_and_grads(full, batch)
    loss_rows, g_rows = m.loss_and_grads(pulled, batch)
    assert loss_rows == pytest.approx(loss_full, rel=1e-12)
    for name in g_full:
        a, b = g_full[name], g_rows[name]
        if isinstance(a, SparseGradient):
            np.testing.assert_array_equal(a.indices, b.indices)  # global row ids
            np.testing.assert_allclose(a.values, b.values, rtol=1e-12)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12)
    # the gradients with pulled rows pass through check_params too
    check_gradients(m, pulled, batch)
    # a row that was not pulled
    short = dict(pulled)
    short["emb0"] = Rows(needed["emb0"][1:], full["emb0"][needed["emb0"][1:]])
    missing = int(needed["emb0"][0])
    with pytest.raises(InvalidArgumentError, match=f"row {missing} of 'emb0' was not pulled"):
        m.loss_and_grads(short, batch)


def test_embbag_spec_init_and_errors():
    m = build_model(
        "embbag:tables=100x2-7,dim=4,dense=3,hidden=16-8,classes=2,pool=mean,bag=5,seed=9"
    )
    assert isinstance(m, EmbeddingBagMLP)
    assert (m.vocab, m.dim, m.n_dense, m.hidden, m.classes, m.pool, m.bag, m.seed) == (
        (100, 100, 7),
        4,
        3,
        (16, 8),
        2,
        "mean",
        5,
        9,
    )
    assert build_model(m.spec).spec == m.spec
    specs = {p.name: p for p in m.params_spec()}
    assert [n for n in specs] == ["emb0", "emb1", "emb2", "W1", "b1", "W2", "b2", "W3", "b3"]
    assert specs["emb2"].shape == (7, 4) and specs["emb2"].sparse
    assert specs["W1"].shape == (3 * 4 + 3, 16) and not specs["W1"].sparse
    params = m.init_params(np.random.default_rng(0))
    again = m.init_params(np.random.default_rng(0))
    assert all(np.array_equal(params[k], again[k]) for k in params)
    # the dense layers follow W4's stream; the tables come from their own seeded init
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((15, 16), np.float32) * np.sqrt(2 / 15)
    np.testing.assert_array_equal(params["W1"], w1.astype(np.float32))
    assert np.abs(params["emb0"]).max() <= 2 / math.sqrt(4) + 1e-6  # truncated normal
    assert not np.array_equal(params["emb0"], params["emb1"])
    dense, ids, y = data.synthetic_ctr(4, m.vocab, bag=2, dense=3, classes=2)
    ids[2, 2, 1] = 7
    with pytest.raises(InvalidArgumentError, match=r"ids\[2, 2, 1\] = 7 is not in \[0, 7\)"):
        m.loss_and_grads(params, (dense, ids, y))
    with pytest.raises(InvalidArgumentError, match=r"ids must be int \[N, 3, L\]"):
        m.loss_and_grads(params, (dense, ids[:, :2], y))
    with pytest.raises(InvalidArgumentError, match=r"is \(dense, ids, y\)"):
        m.rows_needed((ids, y))
    with pytest.raises(InvalidArgumentError, match="pool must be one of sum, mean"):
        EmbeddingBagMLP([3], 2, pool="max")
    with pytest.raises(InvalidArgumentError, match="at least one field"):
        EmbeddingBagMLP([], 2)


def test_embbag_sgd_learns_synthetic_ctr():
    m = build_model("embbag:tables=500x3-100,dim=8,dense=4,hidden=32,bag=3")
    dense, ids, y = data.synthetic_ctr(4000, m.vocab, bag=3, dense=4, seed=0, ragged=True)
    assert 0.3 < y.mean() < 0.7
    train, test = (dense[:3000], ids[:3000], y[:3000]), (dense[3000:], ids[3000:], y[3000:])
    params = m.init_params(np.random.default_rng(0))
    before = m.accuracy(params, test)
    batches = data.minibatches(3000, 64, np.random.default_rng(1))
    for _ in range(600):
        batch = data.take(train, next(batches))
        needed = m.rows_needed(batch)  # a worker pulls only these rows
        pulled = {**params, **{n: Rows(r, params[n][r]) for n, r in needed.items()}}
        _, grads = m.loss_and_grads(pulled, batch)
        for k, g in grads.items():
            if isinstance(g, SparseGradient):
                params[k][g.indices] -= np.float32(0.1) * g.values
            else:
                params[k] -= np.float32(0.1) * g
    after = m.accuracy(params, test)
    assert after >= 0.7 and after > before + 0.1, (before, after)


# -------------------------------------------------------------------------- variables


def test_param_specs_map_onto_variables():
    m = build_model("embbag:tables=10,dim=2,hidden=none")
    vs = m.variables(container="c1")
    assert list(vs) == ["emb0", "W1", "b1"]
    assert vs["emb0"].shape == (10, 2) and vs["emb0"].dtype == np.float32
    assert vs["emb0"].spec.initializer["kind"] == "truncated_normal"
    assert vs["W1"].spec.initializer == {"kind": "array"}
    assert vs["W1"].container == "c1"
    w1 = m.init_params(np.random.default_rng(0))["W1"]
    np.testing.assert_array_equal(vs["W1"].initializer((2, 1), np.float32), w1)
    with pytest.raises(InvalidArgumentError, match="is drawn by init_params"):
        m.params_spec()[1].variable()
    # the tables are not drawn for variables(): only the dense layers are
    drawn = m.init_drawn(np.random.default_rng(0))
    assert list(drawn) == ["W1", "b1"]
    np.testing.assert_array_equal(drawn["W1"], w1)


def test_host_and_device_helpers_on_numpy():
    m = build_model("embbag:tables=10,dim=2,dense=1,hidden=none")
    params = m.init_params(np.random.default_rng(0))
    batch = data.synthetic_ctr(5, m.vocab, bag=2, dense=1)
    needed = m.rows_needed(batch)
    pulled = {**params, "emb0": Rows(needed["emb0"], params["emb0"][needed["emb0"]])}
    moved = params_to(pulled, np)
    assert isinstance(moved["emb0"], Rows) and moved["W1"] is params["W1"]
    _, grads = m.loss_and_grads(moved, batch)
    host = grads_to_host(grads)
    assert isinstance(host["emb0"], SparseGradient) and host["emb0"].indices.dtype == np.int64
    np.testing.assert_array_equal(host["emb0"].indices, needed["emb0"])
    for p in m.params_spec():  # what PSClient.push checks before sending
        spec = VariableSpec(p.dtype, p.shape)
        check_gradient(p.name, spec, host[p.name])


# --------------------------------------------------------------------- spec strings


@pytest.mark.parametrize(
    ("spec", "kind", "text"),
    [
        ("mlp:64,128,10", MLP, "mlp:64,128,10"),
        (" MLP:64, 128 ,10", MLP, "mlp:64,128,10"),
        ("softmax:64,10", SoftmaxRegression, "softmax:64,10"),
        (
            "embbag:tables=5",
            EmbeddingBagMLP,
            "embbag:tables=5,dim=8,dense=0,hidden=64,classes=1,pool=sum,bag=1,seed=0",
        ),
    ],
)
def test_build_model(spec, kind, text):
    m = build_model(spec)
    assert type(m) is kind and m.spec == text
    assert build_model(m.spec).spec == text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mlp", r"'mlp' is not NAME:OPTIONS; names: embbag, mlp, packed, softmax"),
        ("cnn:3", r"unknown model 'cnn'; names: embbag, mlp, packed, softmax, py:MODULE.ATTR"),
        ("mlp:", r"model mlp: options missing; usage: mlp:IN,HIDDEN...,CLASSES"),
        ("mlp:64", r"model mlp: needs at least 2 widths"),
        ("mlp:64,x,10", r"model mlp: 'x' is not an int >= 1; usage: mlp:IN"),
        ("mlp:64,0,10", r"'0' is not an int >= 1"),
        ("mlp:64,1", r"must be >= 2, got 1"),
        ("softmax:64,10,3", r"model softmax: needs exactly 2 numbers"),
        ("embbag:dim=4", r"model embbag: tables= is required"),
        ("embbag:tables=5,size=3", r"unknown option\(s\) size"),
        ("embbag:tables=5,dim", r"'dim' is not KEY=VALUE"),
        ("embbag:tables=5,dim=-1", r"dim='-1' is not an int >= 0"),
        ("embbag:tables=5,dim=0", r"dim: every width must be an int >= 1"),
        ("embbag:tables=5x0", r"tables: '5x0' is not SIZE or SIZExCOUNT"),
        ("embbag:tables=5-a", r"tables: 'a' is not SIZE"),
        ("embbag:tables=5,hidden=8-x", r"hidden='8-x': widths >= 1 joined by '-'"),
        ("embbag:tables=5,pool=max", r"pool must be one of sum, mean, got 'max'"),
        ("embbag:tables=5,dim=2,dim=3", r"dim given twice"),
        ("py:nomodule", r"expected py:MODULE.ATTR"),
        ("py:no_such_module_xyz.Model", r"cannot import no_such_module_xyz"),
        ("py:math.no_such", r"math has no callable 'no_such'"),
        ("py:builtins.object", r"built a object without params_spec"),
    ],
)
def test_build_model_errors(spec, message):
    with pytest.raises(InvalidArgumentError, match=message):
        build_model(spec)


def test_register_model():
    register_model("tiny", lambda opts: SoftmaxRegression(int(opts), 2), "tiny:IN")
    try:
        assert "tiny" in model_names()
        assert build_model("tiny:3").widths == (3, 2)
        with pytest.raises(InvalidArgumentError, match="options missing; usage: tiny:IN"):
            build_model("tiny:")
    finally:
        from workers.models import registry

        registry._FACTORIES.pop("tiny")
    with pytest.raises(InvalidArgumentError, match="reserved"):
        register_model("py", build_model)
    with pytest.raises(InvalidArgumentError, match=r"\[a-z0-9_\]\+"):
        register_model("My-Model", build_model)


# ------------------------------------------------------------ the docs/models.md example


def docs_example() -> str:
    text = DOCS.read_text()
    m = re.search(r"<!-- example: user-model -->\s*```python[^\n]*\n(.*?)```", text, re.S)
    assert m, "docs/models.md lost its user-model example"
    return m.group(1)


def test_docs_user_model_example(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(docs_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    import my_models

    model = build_model("py:my_models.make_model:3")
    assert isinstance(model, Model) and isinstance(model, BaseModel)
    assert model.spec == "py:my_models.make_model:3,16,2"
    assert build_model(model.spec).spec == model.spec
    params = model.init_params(np.random.default_rng(0))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((20, 3))
    y = rng.integers(0, 2, 20)
    check_gradients(model, {k: v.astype(np.float64) for k, v in params.items()}, (x, y))
    accuracy = my_models.train_demo()
    assert accuracy >= 0.9, accuracy


# ------------------------------------------------------------------------------- data


def test_minibatches_follow_w4():
    rng = np.random.default_rng(1)
    got = list(data.minibatches(10, 4, np.random.default_rng(1), epochs=2))
    p1, p2 = rng.permutation(10), rng.permutation(10)
    want = [p1[:4], p1[4:8], p2[:4], p2[4:8]]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    with pytest.raises(InvalidArgumentError, match=r"batch_size 11 is not in \[1, 10\]"):
        next(data.minibatches(10, 11, rng))


def test_load_digits_is_w4s():
    d = data.load_digits()
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    np.testing.assert_allclose(d.x_train.mean(axis=0), 0, atol=1e-5)
    assert sorted(set(d.y_test.tolist())) == list(range(10))


def test_teacher_data_draws_in_w5s_order():
    d = data.teacher_data(n_train=50, n_test=20, features=6, classes=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 6), np.float32)
    t = rng.standard_normal((6, 3), np.float32)
    xte = rng.standard_normal((20, 6), np.float32)
    np.testing.assert_array_equal(d.x_train, x)
    np.testing.assert_array_equal(d.x_test, xte)
    np.testing.assert_array_equal(d.y_train, np.argmax(x @ t, axis=1))
    assert d.y_test.dtype == np.int64


def test_synthetic_ctr_is_seeded_and_shaped():
    a = data.synthetic_ctr(100, [20, 5], bag=4, dense=2, seed=3, ragged=True)
    b = data.synthetic_ctr(100, [20, 5], bag=4, dense=2, seed=3, ragged=True)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    dense, ids, y = a
    assert dense.shape == (100, 2) and dense.dtype == np.float32
    assert ids.shape == (100, 2, 4) and ids.dtype == np.int64
    assert (ids[:, :, 0] >= 0).all() and (ids == -1).any()  # bags of 1..4 ids
    assert ids[:, 0].max() < 20 and ids[:, 1].max() < 5
    assert set(np.unique(y)) <= {0, 1}
    _, _, y3 = data.synthetic_ctr(100, [20], classes=3)
    assert set(np.unique(y3)) <= {0, 1, 2}
    with pytest.raises(InvalidArgumentError, match="bad sizes"):
        data.synthetic_ctr(10, [0])


def test_load_xy(tmp_path):
    x, y = np.arange(6.0).reshape(3, 2), np.array([0, 1, 0])
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.savez(tmp_path / "pos.npz", x, y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    for args in (
        [tmp_path / "d.npz"],
        [tmp_path / "pos.npz"],
        [tmp_path / "x.npy", tmp_path / "y.npy"],
    ):
        gx, gy = data.load_xy(*args)
        np.testing.assert_array_equal(gx, x)
        np.testing.assert_array_equal(gy, y)
    np.savez(tmp_path / "three.npz", a=x, b=y, c=y)
    with pytest.raises(InvalidArgumentError, match="expected arrays 'x' and 'y'"):
        data.load_xy(tmp_path / "three.npz")
    with pytest.raises(InvalidArgumentError, match="give y_path too"):
        data.load_xy(tmp_path / "x.npy")
    np.save(tmp_path / "y2.npy", y[:2])
    with pytest.raises(InvalidArgumentError, match="do not have the same length"):
        data.load_xy(tmp_path / "x.npy", tmp_path / "y2.npy")
    with pytest.raises(InvalidArgumentError, match=r"expected a \.npz or \.npy"):
        data.load_xy(tmp_path / "x.csv")
    np.save(tmp_path / "obj.npy", np.array([{}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        data.load_xy(tmp_path / "obj.npy", tmp_path / "y.npy")


# -------------------------------------------------------------------------------- GPU

needs_gpu = pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "spec",
    [
        "mlp:20,32,16,5",
        "softmax:20,5",
        "embbag:tables=60x2-9,dim=8,dense=20,hidden=16,classes=1",
        "embbag:tables=60,dim=8,dense=20,hidden=16,classes=4,pool=mean",
    ],
)
def test_gpu_model_twin(spec):
    import cupy as cp

    m = build_model(spec)
    params = m.init_params(np.random.default_rng(0))
    rng = np.random.default_rng(1)
    if isinstance(m, EmbeddingBagMLP):
        batch = data.synthetic_ctr(
            64, m.vocab, bag=3, dense=m.n_dense, classes=m.classes, ragged=True
        )
    else:
        batch = (rng.standard_normal((64, 20), np.float32), rng.integers(0, 5, 64))
    dev_params = {k: cp.asarray(v) for k, v in params.items()}
    dev_batch = tuple(cp.asarray(a) for a in batch)
    loss_h, g_h = m.loss_and_grads(params, batch)
    loss_d, g_d = m.loss_and_grads(dev_params, dev_batch)
    assert loss_d == pytest.approx(loss_h, rel=1e-4)
    for k, gh in g_h.items():
        gd = g_d[k]
        if isinstance(gh, SparseGradient):
            np.testing.assert_array_equal(cp.asnumpy(gd.indices), gh.indices)
            gd, gh = gd.values, gh.values
        assert backend.is_cupy_array(gd)
        np.testing.assert_allclose(cp.asnumpy(gd), gh, rtol=1e-3, atol=1e-5, err_msg=k)
    assert m.accuracy(dev_params, dev_batch) == pytest.approx(m.accuracy(params, batch))
    # a host batch with device parameters, and the gradients back on the host
    loss_mixed, g_mixed = m.loss_and_grads(params_to(params, cp), batch)
    assert loss_mixed == pytest.approx(loss_h, rel=1e-4)
    host = grads_to_host(g_mixed)
    for p in m.params_spec():
        check_gradient(p.name, VariableSpec(p.dtype, p.shape), host[p.name])
    if isinstance(m, EmbeddingBagMLP):
        needed = m.rows_needed(dev_batch)
        pulled = {**dev_params, **{n: Rows(r, dev_params[n][r]) for n, r in needed.items()}}
        loss_r, _ = m.loss_and_grads(pulled, dev_batch)
        assert loss_r == pytest.approx(loss_h, rel=1e-4)
        # what a worker on a GPU hands it: pulled rows moved to the device, a host batch
        rows = {n: Rows(r, params[n][r]) for n, r in m.rows_needed(batch).items()}
        worker_params = params_to({**params, **rows}, cp)
        loss_w, g_w = m.loss_and_grads(worker_params, batch)
        assert loss_w == pytest.approx(loss_h, rel=1e-4)
        for k, gh in grads_to_host(g_w).items():
            want = g_h[k]
            if isinstance(want, SparseGradient):
                np.testing.assert_array_equal(gh.indices, want.indices)
                gh, want = gh.values, want.values
            np.testing.assert_allclose(gh, want, rtol=1e-3, atol=1e-5, err_msg=k)
