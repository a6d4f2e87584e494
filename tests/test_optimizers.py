"""Optimizer rules (qps.optimizers) against plain-NumPy references of TF1's formulas.

The references below are written from TF 1.x's update formulas (TF's
``Apply*`` kernels), in float64, as pure functions of (w, g, slots, t), independently of
the in-place implementation. The numbered tests are the optimizer conformance cases
(72–79, docs/optimizers.md), whose figures were obtained by running TensorFlow.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qps import backend
from qps.errors import InvalidArgumentError
from qps.optimizers import (
    OPTIMIZERS,
    SGD,
    Adagrad,
    Adam,
    Ftrl,
    Momentum,
    Optimizer,
    RMSProp,
    from_spec,
    make_optimizer,
)

STEPS = 100
F64_RTOL = 1e-6

# --------------------------------------------------------------------------- references

Slots = dict[str, np.ndarray]
Ref = Callable[[np.ndarray, np.ndarray, Slots, int, dict[str, Any]], tuple[np.ndarray, Slots]]


def ref_sgd(w, g, s, t, hp):
    return w - hp["learning_rate"] * g, {}


def ref_momentum(w, g, s, t, hp):
    lr, mu = hp["learning_rate"], hp["momentum"]
    a = mu * s["momentum"] + g
    step = lr * g + lr * mu * a if hp.get("use_nesterov", False) else lr * a
    return w - step, {"momentum": a}


def ref_adagrad(w, g, s, t, hp):
    acc = s["accumulator"] + g**2
    return w - hp["learning_rate"] * g / np.sqrt(acc), {"accumulator": acc}


def adam_lr_t(hp, t):
    b1, b2 = hp.get("beta1", 0.9), hp.get("beta2", 0.999)
    return hp.get("learning_rate", 0.001) * math.sqrt(1 - b2**t) / (1 - b1**t)


def ref_adam(w, g, s, t, hp):
    b1, b2, eps = hp.get("beta1", 0.9), hp.get("beta2", 0.999), hp.get("epsilon", 1e-8)
    m = b1 * s["m"] + (1 - b1) * g
    v = b2 * s["v"] + (1 - b2) * g * g
    return w - adam_lr_t(hp, t) * m / (np.sqrt(v) + eps), {"m": m, "v": v}


def ref_rmsprop(w, g, s, t, hp):
    lr, rho = hp["learning_rate"], hp.get("decay", 0.9)
    mu, eps = hp.get("momentum", 0.0), hp.get("epsilon", 1e-10)
    ms = rho * s["rms"] + (1 - rho) * g * g
    out = {"rms": ms}
    if hp.get("centered", False):
        mg = rho * s["mg"] + (1 - rho) * g
        out["mg"] = mg
        denom = ms - mg * mg + eps
    else:
        denom = ms + eps
    mom = mu * s["momentum"] + lr * g / np.sqrt(denom)
    out["momentum"] = mom
    return w - mom, out


def ref_ftrl(w, g, s, t, hp):
    lr = hp["learning_rate"]
    p = hp.get("learning_rate_power", -0.5)
    l1 = hp.get("l1_regularization_strength", 0.0)
    l2 = hp.get("l2_regularization_strength", 0.0) + hp.get("beta", 0.0) / (2 * lr)
    shrink = hp.get("l2_shrinkage_regularization_strength", 0.0)
    n, z = s["accum"], s["linear"]
    n_new = n + g * g
    z = z + (g + 2 * shrink * w) - (n_new ** (-p) - n ** (-p)) / lr * w
    quad = n_new ** (-p) / lr + 2 * l2
    w = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / quad, 0.0)
    return w, {"accum": n_new, "linear": z}


def ref_slots(name: str, hp: dict[str, Any], shape: tuple[int, ...]) -> Slots:
    """TF1's slot initial values, written out independently of the implementation."""
    z = np.zeros(shape)
    if name == "sgd":
        return {}
    if name == "momentum":
        return {"momentum": z.copy()}
    if name == "adagrad":
        return {"accumulator": np.full(shape, hp.get("initial_accumulator_value", 0.1))}
    if name == "adam":
        return {"m": z.copy(), "v": z.copy()}
    if name == "rmsprop":
        s = {"rms": np.ones(shape), "momentum": z.copy()}
        if hp.get("centered", False):
            s["mg"] = z.copy()
        return s
    if name == "ftrl":
        return {
            "accum": np.full(shape, hp.get("initial_accumulator_value", 0.1)),
            "linear": z.copy(),
        }
    raise AssertionError(name)


REFS: dict[str, Ref] = {
    "sgd": ref_sgd,
    "momentum": ref_momentum,
    "adagrad": ref_adagrad,
    "adam": ref_adam,
    "rmsprop": ref_rmsprop,
    "ftrl": ref_ftrl,
}

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("sgd", "sgd", {"learning_rate": 0.1}),
    ("momentum", "momentum", {"learning_rate": 0.05, "momentum": 0.9}),
    ("nesterov", "momentum", {"learning_rate": 0.05, "momentum": 0.9, "use_nesterov": True}),
    ("adagrad", "adagrad", {"learning_rate": 0.1}),
    ("adagrad-acc0.5", "adagrad", {"learning_rate": 0.3, "initial_accumulator_value": 0.5}),
    ("adam", "adam", {"learning_rate": 0.01}),
    ("adam-lazy", "adam",
     {"learning_rate": 0.02, "beta1": 0.5, "beta2": 0.9, "epsilon": 1e-3, "lazy": True}),
    ("rmsprop", "rmsprop", {"learning_rate": 0.01}),
    ("rmsprop-momentum", "rmsprop", {"learning_rate": 0.01, "momentum": 0.5}),
    ("rmsprop-centered", "rmsprop",
     {"learning_rate": 0.01, "decay": 0.8, "momentum": 0.9, "centered": True}),
    ("ftrl-l1-l2", "ftrl",
     {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.01}),
    ("ftrl-power-shrinkage-beta", "ftrl",
     {"learning_rate": 0.2, "learning_rate_power": -0.7, "initial_accumulator_value": 0.0,
      "l1_regularization_strength": 0.02, "l2_shrinkage_regularization_strength": 0.05,
      "beta": 0.5}),
    ("ftrl-fixed-lr", "ftrl", {"learning_rate": 0.1, "learning_rate_power": 0.0}),
]
CONFIGS: list[tuple[str, dict[str, Any]]] = [(name, hp) for _, name, hp in CASES]
CONFIG_IDS = [case_id for case_id, _, _ in CASES]

# float32 implementations against the float64 reference: float32 rounding accumulates
# over 100 steps (observed: at most ~2.5e-5 relative, ~1e-6 absolute).
def tolerance(dtype: type) -> dict[str, float]:
    if dtype == np.float64:
        return {"rtol": F64_RTOL, "atol": 1e-12}
    return {"rtol": 2e-4, "atol": 1e-5}


# ------------------------------------------------------------------ dense, 100 steps


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_dense_matches_reference_for_100_steps(config, dtype):
    name, hp = config
    rng = np.random.default_rng(1234)
    shape = (6, 5)
    w0 = rng.normal(size=shape)
    opt = make_optimizer(name, **hp)

    var = w0.astype(dtype)
    slots = opt.init_slots(var)
    ref_w, ref_s = w0.copy(), ref_slots(name, hp, shape)
    assert set(slots) == set(ref_s) == set(opt.slot_names())
    for k in ref_s:
        np.testing.assert_array_equal(slots[k], ref_s[k].astype(dtype))

    for t in range(1, STEPS + 1):
        g = rng.normal(size=shape)
        opt.apply_dense(var, g.astype(dtype), slots, t)
        ref_w, ref_s = REFS[name](ref_w, g, ref_s, t, hp)
        assert var.dtype == dtype
    tol = tolerance(dtype)
    np.testing.assert_allclose(var, ref_w, **tol)
    for k in ref_s:
        np.testing.assert_allclose(slots[k], ref_s[k], **tol, err_msg=k)


# ------------------------------------------------------------------ sparse, 100 steps


def ref_sparse_step(name, hp, w, idx, vals, s, t):
    """TF's sparse semantics in the plainest form: sum duplicates, then apply the dense
    formula to each named row (lazy), or TF1 Adam's all-rows update."""
    summed: dict[int, np.ndarray] = {}
    for i, row in zip(idx.tolist(), vals):
        summed[i] = summed.get(i, 0.0) + row
    w, s = w.copy(), {k: v.copy() for k, v in s.items()}
    if name == "adam" and not hp.get("lazy", False):
        b1, b2, eps = hp.get("beta1", 0.9), hp.get("beta2", 0.999), hp.get("epsilon", 1e-8)
        s["m"] *= b1
        s["v"] *= b2
        for i, gi in summed.items():
            s["m"][i] += (1 - b1) * gi
            s["v"][i] += (1 - b2) * gi * gi
        return w - adam_lr_t(hp, t) * s["m"] / (np.sqrt(s["v"]) + eps), s
    for i, gi in summed.items():
        wi, si = REFS[name](w[i], gi, {k: v[i] for k, v in s.items()}, t, hp)
        w[i] = wi
        for k, v in si.items():
            s[k][i] = v
    return w, s


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_sparse_matches_reference_for_100_steps(config, dtype):
    name, hp = config
    rng = np.random.default_rng(99)
    rows, width, touched = 12, 3, 8  # rows 8..11 are never named
    w0 = rng.normal(size=(rows, width))
    opt = make_optimizer(name, **hp)
    var = w0.astype(dtype)
    slots = opt.init_slots(var)
    init_slots = {k: v.copy() for k, v in slots.items()}
    ref_w, ref_s = w0.copy(), ref_slots(name, hp, (rows, width))
    saw_duplicate = False
    for t in range(1, STEPS + 1):
        k = int(rng.integers(0, 7))  # 0..6 rows; 0 is a legal empty update
        idx = rng.integers(0, touched, size=k)
        saw_duplicate |= len(set(idx.tolist())) < k
        vals = rng.normal(size=(k, width))
        idx_dtype = np.int32 if t % 2 else np.int64
        opt.apply_sparse(var, idx.astype(idx_dtype), vals.astype(dtype), slots, t)
        ref_w, ref_s = ref_sparse_step(name, hp, ref_w, idx, vals, ref_s, t)
    assert saw_duplicate
    tol = tolerance(dtype)
    np.testing.assert_allclose(var, ref_w, **tol)
    for k in ref_s:
        np.testing.assert_allclose(slots[k], ref_s[k], **tol, err_msg=k)
    # untouched rows and their slot rows are exactly as they started
    np.testing.assert_array_equal(var[touched:], w0[touched:].astype(dtype))
    for k in slots:
        np.testing.assert_array_equal(slots[k][touched:], init_slots[k][touched:])


def test_sparse_single_step_touches_only_named_rows():
    """A lazy rule changes the named rows (and slot rows) and nothing else."""
    for name, hp in CONFIGS:
        opt = make_optimizer(name, **hp)
        if isinstance(opt, Adam) and not opt.lazy:
            continue  # TF1 Adam is not lazy (case 78)
        var = np.arange(20.0).reshape(5, 4) / 7 + 0.3
        slots = opt.init_slots(var)
        for _ in range(3):  # give the slots non-trivial values everywhere first
            opt.apply_dense(var, np.full_like(var, 0.25), slots, 1)
        before = var.copy(), {k: v.copy() for k, v in slots.items()}
        opt.apply_sparse(var, np.array([3, 1, 3]), np.ones((3, 4)), slots, 4)
        same = [0, 2, 4]
        np.testing.assert_array_equal(var[same], before[0][same], err_msg=name)
        for k in slots:
            np.testing.assert_array_equal(slots[k][same], before[1][k][same], err_msg=name)
        assert not np.array_equal(var[[1, 3]], before[0][[1, 3]]), name


@settings(max_examples=60, deadline=None)
@given(
    config=st.sampled_from(CONFIGS),
    idx=st.lists(st.integers(0, 9), min_size=0, max_size=12),
    seed=st.integers(0, 2**16),
    step=st.integers(1, 1000),
)
def test_sparse_equals_dense_on_the_summed_rows(config, idx, seed, step):
    """For a lazy rule, a sparse update with repeats equals a dense update of the gathered
    rows with the summed gradient (and SGD's equals a dense update with the scattered
    sum everywhere)."""
    name, hp = config
    opt = make_optimizer(name, **hp)
    if isinstance(opt, Adam) and not opt.lazy:
        opt = make_optimizer(name, **{**hp, "lazy": True})
    rng = np.random.default_rng(seed)
    var = rng.normal(size=(10, 2))
    slots = opt.init_slots(var)
    opt.apply_dense(var, rng.normal(size=var.shape), slots, 1)  # non-trivial slots
    vals = rng.normal(size=(len(idx), 2))
    idx_a = np.array(idx, dtype=np.int64)

    uniq = np.unique(idx_a)
    summed = np.zeros((len(uniq), 2))
    np.add.at(summed, np.searchsorted(uniq, idx_a), vals)
    rows = var[uniq].copy()
    row_slots = {k: v[uniq].copy() for k, v in slots.items()}
    opt.apply_dense(rows, summed, row_slots, step)

    opt.apply_sparse(var, idx_a, vals, slots, step)
    np.testing.assert_allclose(var[uniq], rows, rtol=1e-12, atol=1e-15)
    for k in slots:
        np.testing.assert_allclose(slots[k][uniq], row_slots[k], rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------- NumPy block-wise path


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_blocked_apply_equals_whole_array_apply(config, monkeypatch):
    """Large NumPy arrays are updated in cache-sized blocks; the result is bit-identical
    to one whole-array pass, for dense updates and for TF1 Adam's all-rows sparse pass.
    Non-contiguous arrays take the whole-array path."""
    from qps import optimizer_base

    name, hp = config
    opt = make_optimizer(name, **hp)
    rng = np.random.default_rng(5)
    w0 = rng.normal(size=(9, 7))
    grads = [rng.normal(size=w0.shape) for _ in range(5)]
    idx, vals = np.array([1, 4, 4, 8]), rng.normal(size=(4, 7))

    def run(block: int, layout: Callable[[np.ndarray], np.ndarray]) -> list[np.ndarray]:
        monkeypatch.setattr(optimizer_base, "BLOCK_ELEMENTS", block)
        var = layout(w0.copy())
        slots = {k: layout(v) for k, v in opt.init_slots(var).items()}
        for t, g in enumerate(grads, 1):
            opt.apply_dense(var, layout(g), slots, t)
        opt.apply_sparse(var, idx, vals, slots, len(grads) + 1)
        return [np.array(var), *(np.array(slots[k]) for k in sorted(slots))]

    def strided(a: np.ndarray) -> np.ndarray:  # a non-contiguous view with a's values
        big = np.zeros((a.shape[0], a.shape[1] * 2))
        big[:, ::2] = a
        return big[:, ::2]

    whole = run(1 << 30, lambda a: a)
    for block in (1, 5, 16, 63):
        for got, want in zip(run(block, lambda a: a), whole):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(run(5, strided), whole):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------- TF 1.x conformance (72–79)


def one_step(opt: Optimizer, w=1.0, g=0.5, step=1, **slot_values) -> tuple[float, Slots]:
    var = np.array([w])
    slots = opt.init_slots(var)
    for k, v in slot_values.items():
        slots[k][...] = v
    opt.apply_dense(var, np.array([g]), slots, step)
    return float(var[0]), slots


def test_case72_adam_first_steps_move_by_lr():
    opt = Adam(learning_rate=0.1)
    var = np.array([1.0])
    slots = opt.init_slots(var)
    opt.apply_dense(var, np.array([0.5]), slots, 1)
    assert var[0] == pytest.approx(0.9, abs=1e-6)
    opt.apply_dense(var, np.array([0.5]), slots, 2)
    assert var[0] == pytest.approx(0.8, abs=1e-6)


def test_case72_adam_beta_powers_follow_step():
    opt = Adam(learning_rate=0.1)
    assert opt.lr_t(1) == pytest.approx(0.1 * math.sqrt(1 - 0.999) / (1 - 0.9))
    # TF: beta1_power is 0.9**3 = 0.729 after two calls, i.e. the third update uses t=3
    assert opt.lr_t(3) == pytest.approx(0.1 * math.sqrt(1 - 0.999**3) / (1 - 0.729))


def test_case73_momentum_plain_and_nesterov():
    assert one_step(Momentum(0.1, 0.9), momentum=0.2)[0] == pytest.approx(0.932, abs=1e-9)
    w, slots = one_step(Momentum(0.1, 0.9, use_nesterov=True), momentum=0.2)
    assert w == pytest.approx(0.8888, abs=1e-9)
    assert slots["momentum"][0] == pytest.approx(0.68)


def test_case74_rmsprop_with_momentum():
    w, slots = one_step(RMSProp(0.1, decay=0.9, momentum=0.5), rms=1.0, momentum=0.3)
    assert w == pytest.approx(0.798012, abs=1e-6)
    assert slots["rms"][0] == pytest.approx(0.925)


def test_case75_adagrad():
    w, slots = one_step(Adagrad(0.1, initial_accumulator_value=0.1))
    assert w == pytest.approx(0.915485, abs=1e-6)
    assert slots["accumulator"][0] == pytest.approx(0.35)


def test_case76_ftrl():
    opt = Ftrl(
        0.1,
        l1_regularization_strength=0.3,
        l2_regularization_strength=0.1,
        initial_accumulator_value=0.1,
    )
    w, slots = one_step(opt)
    assert w == pytest.approx(0.319453, abs=1e-6)
    assert slots["accum"][0] == pytest.approx(0.35)


def test_case76_ftrl_float32():
    opt = Ftrl(0.1, l1_regularization_strength=0.3, l2_regularization_strength=0.1)
    var = np.ones(3, dtype=np.float32)
    slots = opt.init_slots(var)
    opt.apply_dense(var, np.full(3, 0.5, dtype=np.float32), slots, 1)
    np.testing.assert_allclose(var, 0.319453, atol=1e-6)


def test_case77_sparse_adagrad_sums_duplicates():
    opt = Adagrad(0.1)
    var = np.array([1.0, 1.0])
    slots = opt.init_slots(var)
    opt.apply_sparse(var, np.array([0, 0]), np.array([1.0, 1.0]), slots, 1)
    assert var[0] == pytest.approx(0.901227, abs=1e-6)  # not the sequential 0.835647
    assert slots["accumulator"][0] == pytest.approx(4.1)
    assert var[1] == 1.0 and slots["accumulator"][1] == pytest.approx(0.1)


def test_case78_adam_sparse_is_not_lazy():
    opt = Adam(learning_rate=0.1)
    var = np.array([[1.0], [2.0], [3.0]])
    slots = opt.init_slots(var)
    opt.apply_sparse(var, np.array([0]), np.array([[0.5]]), slots, 1)
    after_first = var.copy()
    assert after_first[0, 0] == pytest.approx(0.9, abs=1e-6)
    opt.apply_sparse(var, np.array([1]), np.array([[0.5]]), slots, 2)
    assert var[0, 0] != after_first[0, 0]  # row 0 moved again without a gradient
    assert var[1, 0] != 2.0
    assert var[2, 0] == 3.0  # never touched: m = 0, so it stays put
    # the lazy variant leaves row 0 alone on the second step
    lazy = Adam(learning_rate=0.1, lazy=True)
    var = np.array([[1.0], [2.0], [3.0]])
    slots = lazy.init_slots(var)
    lazy.apply_sparse(var, np.array([0]), np.array([[0.5]]), slots, 1)
    row0 = var[0, 0]
    lazy.apply_sparse(var, np.array([1]), np.array([[0.5]]), slots, 2)
    assert var[0, 0] == row0 and var[2, 0] == 3.0


def test_case78_adam_sparse_empty_update_still_decays():
    opt = Adam(learning_rate=0.1)
    var = np.array([[1.0], [2.0]])
    slots = opt.init_slots(var)
    opt.apply_sparse(var, np.array([0]), np.array([[0.5]]), slots, 1)
    m0 = slots["m"][0, 0]
    opt.apply_sparse(var, np.zeros(0, dtype=np.int64), np.zeros((0, 1)), slots, 2)
    assert slots["m"][0, 0] == pytest.approx(0.9 * m0)


def test_case79_out_of_range_index_changes_nothing():
    for name, hp in CONFIGS:
        opt = make_optimizer(name, **hp)
        var = np.ones((3, 2))
        slots = opt.init_slots(var)
        snap = var.copy(), {k: v.copy() for k, v in slots.items()}
        with pytest.raises(InvalidArgumentError, match="Index 5 at offset 1 in indices is out of range"):
            opt.apply_sparse(var, np.array([0, 5]), np.ones((2, 2)), slots, 1)
        with pytest.raises(InvalidArgumentError, match="Index -1 at offset 0"):
            opt.apply_sparse(var, np.array([-1]), np.ones((1, 2)), slots, 1)
        np.testing.assert_array_equal(var, snap[0])  # unlike TF's Momentum/FTRL kernels
        for k in slots:
            np.testing.assert_array_equal(slots[k], snap[1][k])


# ------------------------------------------------------------------ defaults and spec


def test_tf1_defaults():
    adam = Adam()
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.epsilon) == (0.001, 0.9, 0.999, 1e-8)
    assert adam.lazy is False
    assert Adagrad(0.1).initial_accumulator_value == 0.1
    r = RMSProp(0.1)
    assert (r.decay, r.momentum, r.epsilon, r.centered) == (0.9, 0.0, 1e-10, False)
    f = Ftrl(0.1)
    assert (f.learning_rate_power, f.initial_accumulator_value) == (-0.5, 0.1)
    assert f.l1_regularization_strength == f.l2_regularization_strength == 0.0
    assert f.l2_shrinkage_regularization_strength == f.beta == 0.0
    assert Momentum(0.1, 0.9).use_nesterov is False


def test_slot_names_and_initial_values():
    var = np.zeros((2, 3), dtype=np.float32)
    expected = {
        SGD(0.1): {},
        Momentum(0.1, 0.9): {"momentum": 0.0},
        Adagrad(0.1): {"accumulator": 0.1},
        Adam(): {"m": 0.0, "v": 0.0},
        RMSProp(0.1): {"rms": 1.0, "momentum": 0.0},
        RMSProp(0.1, centered=True): {"rms": 1.0, "momentum": 0.0, "mg": 0.0},
        Ftrl(0.1, initial_accumulator_value=0.3): {"accum": 0.3, "linear": 0.0},
    }
    for opt, init in expected.items():
        assert set(opt.slot_names()) == set(init)
        slots = opt.init_slots(var)
        for k, v in init.items():
            assert slots[k].dtype == np.float32 and slots[k].shape == (2, 3)
            np.testing.assert_array_equal(slots[k], np.float32(v))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_spec_round_trip_through_json(config):
    name, hp = config
    opt = make_optimizer(name, **hp)
    spec = json.loads(json.dumps(opt.to_spec()))
    assert spec["optimizer"] == name and spec["version"] == 1
    back = from_spec(spec)
    assert back == opt and type(back) is type(opt)
    assert type(opt).from_spec(spec) == opt


@settings(max_examples=50, deadline=None)
@given(
    lr=st.floats(1e-6, 10.0),
    b1=st.floats(0.0, 0.999),
    b2=st.floats(0.0, 0.9999),
    eps=st.floats(1e-12, 1.0),
    lazy=st.booleans(),
)
def test_adam_spec_round_trip_property(lr, b1, b2, eps, lazy):
    opt = Adam(learning_rate=lr, beta1=b1, beta2=b2, epsilon=eps, lazy=lazy)
    assert from_spec(json.loads(json.dumps(opt.to_spec()))) == opt


def test_registry_names_and_aliases():
    assert set(OPTIMIZERS) == {"sgd", "momentum", "adagrad", "adam", "rmsprop", "ftrl"}
    assert isinstance(make_optimizer("GradientDescent", learning_rate=0.1), SGD)
    assert isinstance(make_optimizer("gradient_descent", learning_rate=0.1), SGD)
    assert isinstance(make_optimizer("AdamOptimizer"), Adam)
    assert isinstance(make_optimizer("RMSProp", learning_rate=0.1), RMSProp)
    assert make_optimizer("adam", learning_rate=1) == Adam(learning_rate=1.0)


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"optimizer": "adam", "version": 2, "hparams": {}}, "version"),
        ({"optimizer": "nadam", "version": 1, "hparams": {}}, "unknown optimizer"),
        ({"optimizer": "adam", "version": 1, "hparams": {"beta3": 0.1}}, "beta3"),
        ({"optimizer": "adam", "version": 1, "hparams": {}, "x": 1}, "unknown key"),
        ({"optimizer": "sgd", "version": 1, "hparams": {}}, "missing learning_rate"),
        ({"optimizer": 3, "version": 1, "hparams": {}}, "must be a str"),
        ({"optimizer": "adam", "version": 1, "hparams": [1]}, "mapping"),
        ([("optimizer", "adam")], "mapping"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(InvalidArgumentError, match=match):
        from_spec(spec)


def test_from_spec_on_the_wrong_class():
    with pytest.raises(InvalidArgumentError, match="not a Adagrad"):
        Adagrad.from_spec(Adam().to_spec())


# ------------------------------------------------------------------ bad hyper-parameters


@pytest.mark.parametrize(
    "name, hp, match",
    [
        ("sgd", {"learning_rate": -0.1}, "learning_rate must be >= 0"),
        ("sgd", {"learning_rate": float("nan")}, "finite"),
        ("sgd", {"learning_rate": "0.1"}, "must be a number"),
        ("sgd", {"learning_rate": True}, "must be a number"),
        ("momentum", {"learning_rate": 0.1}, "missing momentum"),
        ("momentum", {"learning_rate": 0.1, "momentum": -0.5}, "momentum must be >= 0"),
        ("momentum", {"learning_rate": 0.1, "momentum": 0.9, "use_nesterov": 1}, "bool"),
        ("adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.0}, "> 0"),
        ("adam", {"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
        ("adam", {"beta2": -0.1}, "beta2"),
        ("adam", {"epsilon": 0.0}, "epsilon must be > 0"),
        ("adam", {"learning_rate": float("inf")}, "finite"),
        ("adam", {"lazy": "yes"}, "bool"),
        ("rmsprop", {"learning_rate": 0.1, "decay": 1.5}, "decay"),
        ("rmsprop", {"learning_rate": 0.1, "epsilon": -1e-10}, "epsilon"),
        ("rmsprop", {"learning_rate": 0.1, "momentum": -1}, "momentum"),
        ("ftrl", {"learning_rate": 0.0}, "learning_rate must be > 0"),
        ("ftrl", {"learning_rate": 0.1, "learning_rate_power": 0.5}, "<= 0"),
        ("ftrl", {"learning_rate": 0.1, "initial_accumulator_value": -0.1}, ">= 0"),
        ("ftrl", {"learning_rate": 0.1, "l1_regularization_strength": -1}, "l1"),
        ("ftrl", {"learning_rate": 0.1, "l2_regularization_strength": -1}, "l2_reg"),
        ("ftrl", {"learning_rate": 0.1, "l2_shrinkage_regularization_strength": -1}, "shrinkage"),
        ("ftrl", {"learning_rate": 0.1, "beta": -1}, "beta"),
        ("ftrl", {"learning_rate": 0.1, "l3": 1}, "unknown hyper-parameter"),
    ],
)
def test_bad_hyper_parameters(name, hp, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_optimizer(name, **hp)


def test_bad_hyper_parameters_direct_constructor():
    with pytest.raises(InvalidArgumentError, match="beta1"):
        Adam(beta1=-0.1)
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError
        Ftrl(learning_rate=-1.0)


# ---------------------------------------------------------------------- bad arguments


def _assert_unchanged(opt, var, slots, call):
    snap = var.copy(), {k: v.copy() for k, v in slots.items()}
    call()
    np.testing.assert_array_equal(var, snap[0])
    for k in slots:
        np.testing.assert_array_equal(slots[k], snap[1][k])


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_bad_arguments_raise_and_change_nothing(config):
    name, hp = config
    opt = make_optimizer(name, **hp)
    var = np.ones((4, 3))
    slots = opt.init_slots(var)
    cases: list[tuple[Callable[[], None], str]] = [
        (lambda: opt.apply_dense(var, np.ones((4, 2)), slots, 1), "same shape"),
        (lambda: opt.apply_dense(var, np.ones((4, 3), np.float32), slots, 1), "dtype"),
        (lambda: opt.apply_dense(var, np.ones((4, 3)), slots, 0), "step"),
        (lambda: opt.apply_dense(var, np.ones((4, 3)), slots, 1.0), "step"),
        (lambda: opt.apply_dense(var, np.ones((4, 3)), slots, True), "step"),
        (lambda: opt.apply_sparse(var, np.array([0]), np.ones((2, 3)), slots, 1), "first dimension"),
        (lambda: opt.apply_sparse(var, np.array([0]), np.ones((1, 2)), slots, 1), "rows have shape"),
        (lambda: opt.apply_sparse(var, np.array([0.0]), np.ones((1, 3)), slots, 1), "integer"),
        (lambda: opt.apply_sparse(var, np.array([[0]]), np.ones((1, 3)), slots, 1), "1-D"),
        (lambda: opt.apply_sparse(var, np.array([0]), np.ones((1, 3), np.float32), slots, 1), "dtype"),
        (lambda: opt.apply_sparse(var, np.array([4], np.uint32), np.ones((1, 3)), slots, 1), "Index 4"),
    ]
    if slots:
        first = next(iter(slots))
        bad_slots = {**slots, first: np.ones((4, 2))}
        missing = {k: v for k, v in slots.items() if k != first}
        cases += [
            (lambda: opt.apply_dense(var, np.ones((4, 3)), bad_slots, 1), "must match var"),
            (lambda: opt.apply_dense(var, np.ones((4, 3)), missing, 1), "missing"),
        ]
    for call, match in cases:
        def check(call=call, match=match):
            with pytest.raises(InvalidArgumentError, match=match):
                call()
        _assert_unchanged(opt, var, slots, check)


def test_var_must_be_a_writable_float_array():
    opt = SGD(0.1)
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        opt.apply_dense(ro, np.ones(3), {}, 1)
    with pytest.raises(InvalidArgumentError, match="floating"):
        opt.apply_dense(np.ones(3, dtype=np.int64), np.ones(3, dtype=np.int64), {}, 1)
    with pytest.raises(InvalidArgumentError, match="ndarray"):
        opt.init_slots([1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match="rank"):
        opt.apply_sparse(np.array(1.0), np.array([0]), np.ones(1), {}, 1)


def test_read_only_gradients_are_fine():
    """Gradients decoded from the wire are read-only views; they are only read."""
    for name, hp in CONFIGS:
        opt = make_optimizer(name, **hp)
        var = np.ones((3, 2))
        slots = opt.init_slots(var)
        g = np.full((3, 2), 0.5)
        g.flags.writeable = False
        opt.apply_dense(var, g, slots, 1)
        vals = np.full((2, 2), 0.5)
        vals.flags.writeable = False
        idx = np.array([2, 2])
        idx.flags.writeable = False
        opt.apply_sparse(var, idx, vals, slots, 2)


def test_scalar_variables_dense():
    for name, hp in CONFIGS:
        opt = make_optimizer(name, **hp)
        var = np.array(1.0)
        slots = opt.init_slots(var)
        ref_w, ref_s = np.array(1.0), ref_slots(name, hp, ())
        for t in range(1, 4):
            opt.apply_dense(var, np.array(0.5), slots, t)
            ref_w, ref_s = REFS[name](ref_w, np.array(0.5), ref_s, t, hp)
        assert float(var) == pytest.approx(float(ref_w), rel=1e-12)


# --------------------------------------------------------------------------- backend


def test_backend_choice_without_cupy_is_numpy():
    assert backend.choose("numpy") is np
    assert backend.choose(" NumPy ") is np
    if not backend.gpu_available():
        assert backend.choose(None) is np
        assert backend.choose("auto") is np
        assert backend.get_xp() is np
        assert backend.backend_name() == "numpy"
        with pytest.raises(RuntimeError, match="QPS_BACKEND=cupy"):
            backend.choose("cupy")
    with pytest.raises(ValueError, match="QPS_BACKEND"):
        backend.choose("jax")


def test_backend_helpers_on_numpy_arrays():
    a = np.arange(3.0)
    assert backend.xp_of(a, [1, 2]) is np
    assert backend.asnumpy(a) is a
    assert backend.asnumpy([1, 2]).tolist() == [1, 2]
    assert backend.to_backend(a, np) is a
    assert not backend.is_cupy_array(a)


# ------------------------------------------------------------------------------- GPU

needs_gpu = pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_cupy_matches_numpy(config, dtype, fused, monkeypatch):
    import cupy as cp

    from qps import optimizer_base

    monkeypatch.setattr(optimizer_base, "use_fused_kernels", fused)
    name, hp = config
    opt = make_optimizer(name, **hp)
    rng = np.random.default_rng(7)
    var_h = rng.normal(size=(64, 8)).astype(dtype)
    var_d = cp.asarray(var_h)
    slots_h, slots_d = opt.init_slots(var_h), opt.init_slots(var_d)
    assert all(backend.is_cupy_array(s) for s in slots_d.values())
    for t in range(1, 21):
        g = rng.normal(size=var_h.shape).astype(dtype)
        opt.apply_dense(var_h, g, slots_h, t)
        opt.apply_dense(var_d, cp.asarray(g), slots_d, t)
        idx = rng.integers(0, 40, size=16)
        vals = rng.normal(size=(16, 8)).astype(dtype)
        opt.apply_sparse(var_h, idx, vals, slots_h, t)
        opt.apply_sparse(var_d, cp.asarray(idx), cp.asarray(vals), slots_d, t)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == np.float64 else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(backend.asnumpy(var_d), var_h, **tol)
    for k in slots_h:
        np.testing.assert_allclose(backend.asnumpy(slots_d[k]), slots_h[k], **tol, err_msg=k)
