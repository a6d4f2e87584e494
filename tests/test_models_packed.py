"""workers.models.packed: a model's dense parameters as a few flat variables, the same
arithmetic as the model itself."""

from __future__ import annotations

import numpy as np
import pytest

from qps import optimizers
from qps.errors import InvalidArgumentError
from workers import data
from workers.models import MLP, BaseModel, EmbeddingBagMLP, Packed, ParamSpec, build_model
from workers.models.packed import PACK_PREFIX


def digits_batches(n: int, seed: int = 1):
    d = data.load_digits()
    order = data.minibatches(len(d.y_train), 64, np.random.default_rng(seed))
    return d, [data.take((d.x_train, d.y_train), next(order)) for _ in range(n)]


@pytest.mark.parametrize("groups", [1, 2, 3, 7])
def test_parts_cut_the_joined_parameters_evenly_and_round_trip(groups):
    m = MLP([64, 128, 10])
    p = Packed(m, groups)
    spec = p.params_spec()
    assert [s.name for s in spec] == [f"{PACK_PREFIX}{k}" for k in range(groups)]
    sizes = [s.size for s in spec]
    assert sum(sizes) == m.num_params == 9610 and max(sizes) - min(sizes) <= 1
    assert all(s.dtype == np.float32 and not s.sparse for s in spec)
    values = m.init_params(np.random.default_rng(0))
    assert list(values) == ["W1", "b1", "W2", "b2"]
    parts = p.pack(values)
    assert list(parts) == [s.name for s in spec]
    joined = np.concatenate([parts[s.name] for s in spec])
    assert np.array_equal(joined, np.concatenate([v.reshape(-1) for v in values.values()]))
    back = p.unpack(parts)
    assert list(back) == list(values)
    for name, v in values.items():
        assert back[name].shape == v.shape and np.array_equal(back[name], v)
    # the chief's initial values are the inner model's, drawn from the same stream
    init = p.init_drawn(np.random.default_rng(0))
    assert list(init) == list(parts) == [f"{PACK_PREFIX}{k}" for k in range(groups)]
    assert all(np.array_equal(init[k], parts[k]) for k in parts)


def test_one_part_is_read_without_a_copy():
    m = MLP([6, 4, 3])
    p = Packed(m)
    parts = p.init_params(np.random.default_rng(0))
    assert list(parts) == ["packed/0"]
    back = p.unpack(parts)
    assert list(back) == ["W1", "b1", "W2", "b2"]
    assert all(np.shares_memory(v, parts["packed/0"]) for v in back.values())


@pytest.mark.parametrize("groups", [1, 2])
def test_sgd_on_the_parts_is_sgd_on_the_model_bit_for_bit(groups):
    """Training the packed model (the parts updated as a PS shard updates variables)
    gives the very numbers training the model does: the update is element by element."""
    d, batches = digits_batches(200)
    m = MLP([64, 128, 10])
    p = Packed(m, groups)
    plain = m.init_params(np.random.default_rng(0))
    parts = p.init_params(np.random.default_rng(0))
    for batch in batches:
        loss_a, ga = m.loss_and_grads(plain, batch)
        loss_b, gb = p.loss_and_grads(parts, batch)
        assert loss_a == loss_b and set(gb) == set(parts)
        for k, g in ga.items():
            plain[k] -= np.float32(0.05) * g
        for k, g in gb.items():
            parts[k] -= np.float32(0.05) * g
    back = p.unpack(parts)
    assert list(back) == list(plain) == ["W1", "b1", "W2", "b2"]
    assert all(np.array_equal(back[k], plain[k]) for k in plain)
    assert p.accuracy(parts, (d.x_test, d.y_test)) == m.accuracy(plain, (d.x_test, d.y_test))
    assert p.accuracy(parts, (d.x_test, d.y_test)) >= 0.9
    assert p.loss(parts, batches[0]) == m.loss(plain, batches[0])


@pytest.mark.parametrize(
    ("name", "hparams"),
    [("adam", {}), ("momentum", {"momentum": 0.9}), ("rmsprop", {}), ("adagrad", {}), ("ftrl", {})],
)
def test_every_dense_optimizer_updates_parts_as_it_updates_the_variables(name, hparams):
    """The optimizers' dense rules (slots included) act element by element: applied to
    a part they give what they give applied to each parameter."""
    _, batches = digits_batches(5)
    m = MLP([64, 16, 10])
    p = Packed(m)
    opt = optimizers.make_optimizer(name, learning_rate=0.01, **hparams)
    plain = m.init_params(np.random.default_rng(0))
    plain_slots = {k: opt.init_slots(v) for k, v in plain.items()}
    parts = p.init_params(np.random.default_rng(0))
    part_slots = {k: opt.init_slots(v) for k, v in parts.items()}
    for t, batch in enumerate(batches, start=1):
        _, ga = m.loss_and_grads(plain, batch)
        _, gb = p.loss_and_grads(parts, batch)
        for k, g in ga.items():
            opt.apply_dense(plain[k], g, plain_slots[k], t)
        for k, g in gb.items():
            opt.apply_dense(parts[k], g, part_slots[k], t)
    back = p.unpack(parts)
    assert list(back) == list(plain) == ["W1", "b1", "W2", "b2"]
    for k in plain:
        np.testing.assert_allclose(back[k], plain[k], rtol=1e-6, atol=1e-7)


def test_sparse_tables_stay_variables_of_their_own():
    m = EmbeddingBagMLP([50, 20], 4, dense=3, hidden=[8])
    p = Packed(m, 2)
    names = [s.name for s in p.params_spec()]
    sparse = [s.name for s in m.params_spec() if s.sparse]
    assert sparse == ["emb0", "emb1"]
    assert names == ["packed/0", "packed/1", *sparse]
    assert [s.sparse for s in p.params_spec()] == [False, False, True, True]
    dense_x, ids, y = data.synthetic_ctr(8, m.vocab, bag=2, dense=3, seed=3)
    batch = (dense_x, ids, y)
    assert {k: list(v) for k, v in p.rows_needed(batch).items()} == {
        k: list(v) for k, v in m.rows_needed(batch).items()
    }
    values = m.init_params(np.random.default_rng(0))
    parts = p.pack(values)
    loss_a, ga = m.loss_and_grads(values, batch)
    loss_b, gb = p.loss_and_grads(parts, batch)
    assert loss_a == loss_b
    for k in sparse:
        assert np.array_equal(gb[k].indices, ga[k].indices)
        assert np.array_equal(gb[k].values, ga[k].values)
    dense_grads = p.unpack({**gb, **{k: values[k] for k in sparse}})
    dense = [s.name for s in m.params_spec() if not s.sparse]
    assert dense == ["W1", "b1", "W2", "b2"]
    for name in dense:
        assert np.array_equal(dense_grads[name], ga[name])
    # the chief draws no table through the packed model either
    assert set(p.init_drawn(np.random.default_rng(0))) == {"packed/0", "packed/1"}


class _Custom(BaseModel):
    spec = "py:custom"

    def __init__(self, specs):
        self._specs = specs

    def params_spec(self):
        return list(self._specs)


@pytest.mark.parametrize(
    ("model", "groups", "message"),
    [
        (MLP([4, 2]), 0, r"groups must be an int >= 1, got 0"),
        (MLP([4, 2]), True, r"groups must be an int >= 1, got True"),
        (MLP([4, 2]), 11, r"11 groups for 10 dense elements"),
        (_Custom([ParamSpec("t", (5, 2), sparse=True)]), 1, r"has no dense parameter to pack"),
        (
            _Custom([ParamSpec("a", (2,)), ParamSpec("b", (2,), np.dtype(np.float64))]),
            1,
            r"several dtypes \(float32, float64\)",
        ),
        (_Custom([ParamSpec("packed/1", (4,))]), 2, r"already has packed/1"),
    ],
)
def test_packed_errors(model, groups, message):
    with pytest.raises(InvalidArgumentError, match=message):
        Packed(model, groups)


def test_parts_of_another_size_are_refused():
    p = Packed(MLP([4, 3, 2]))
    with pytest.raises(
        InvalidArgumentError, match=r"the parts hold 5 elements, 'mlp:4,3,2' needs 23"
    ):
        p.unpack({"packed/0": np.zeros(5, np.float32)})


@pytest.mark.parametrize(
    ("spec", "text", "groups"),
    [
        ("packed:mlp:64,128,10", "packed:mlp:64,128,10", 1),
        ("packed:1:mlp:64,128,10", "packed:mlp:64,128,10", 1),
        ("packed:2:mlp:64,128,10", "packed:2:mlp:64,128,10", 2),
        ("PACKED:3:softmax:64,10", "packed:3:softmax:64,10", 3),
    ],
)
def test_packed_spec_strings(spec, text, groups):
    m = build_model(spec)
    assert isinstance(m, Packed) and m.spec == text and m.groups == groups
    assert build_model(m.spec).spec == text
    assert isinstance(m.inner, MLP)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("packed:", r"model packed: options missing; usage: packed:\[GROUPS:\]INNER"),
        ("packed:0:mlp:4,2", r"GROUPS must be >= 1"),
        ("packed:packed:mlp:4,2", r"a packed model cannot be packed again"),
        ("packed:2:packed:mlp:4,2", r"a packed model cannot be packed again"),
        ("packed:mlp:4", r"model mlp: needs at least 2 widths"),
        ("packed:2", r"'2' is not NAME:OPTIONS"),
    ],
)
def test_packed_spec_errors(spec, message):
    with pytest.raises(InvalidArgumentError, match=message):
        build_model(spec)


def test_auto_packed_packs_only_a_small_dense_model():
    """Training packs a model by itself (qps worker --pack) where that pays: two or
    more dense parameters of one dtype, no table, at most AUTO_PACK_MAX elements; one
    part per shard, never more parts than elements."""
    from workers.models import AUTO_PACK_MAX, auto_packed, packed_inner

    m = MLP([64, 128, 10])
    one, two = auto_packed(m, 1), auto_packed(m, 2)
    assert isinstance(one, Packed) and one.spec == "packed:mlp:64,128,10"
    assert isinstance(two, Packed) and two.groups == 2 and two.spec == "packed:2:mlp:64,128,10"
    assert auto_packed(one, 3) is one  # packed already
    assert auto_packed(MLP([1, 1, 2]), 10).groups == 6  # 6 elements: at most 6 parts
    big = MLP([1024, AUTO_PACK_MAX // 1024, 2])
    assert big.num_params > AUTO_PACK_MAX and auto_packed(big, 1) is big
    table = EmbeddingBagMLP([50], 4, dense=2, hidden=[8])
    assert auto_packed(table, 1) is table  # an embedding table: rows, not one vector
    assert packed_inner("packed:2:mlp:64,128,10") == "mlp:64,128,10"
    assert packed_inner("packed:mlp:64,128,10") == "mlp:64,128,10"
    assert packed_inner("mlp:64,128,10") is None


def test_the_layout_names_each_parameter_of_the_parts():
    from qps.packing import PackLayout

    p = Packed(MLP([6, 4, 3]), 2)
    layout = p.layout()
    assert layout.parts == (("packed/0", 21), ("packed/1", 22))
    assert layout.names() == ["W1", "b1", "W2", "b2"]
    assert layout.locate("W2") == (28, 40, (4, 3)) and layout.locate("nope") is None
    assert PackLayout.from_json(layout.to_json()) == layout
    with pytest.raises(InvalidArgumentError, match="not a packed-model layout"):
        PackLayout.from_json('{"dtype": "float32"}')
