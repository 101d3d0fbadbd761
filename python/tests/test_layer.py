"""The MoE layer through NumPy against the float64 reference."""

import numpy as np
import pytest

import lrmoe
import reference as ref


def close(a, b, what, rtol=2e-4, atol=2e-5):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = max(1.0, float(np.abs(b).max()))
    err = float(np.abs(a - b).max()) / scale
    assert err <= rtol + atol, f"{what}: max error {err:.3g} (relative to {scale:.3g})"


def test_expert_load_counts_the_pairs_a_capacity_keeps():
    rng = np.random.default_rng(3)
    w, x, _ = ref.random_layer(rng)
    layer = lrmoe.Layer(16, 24, 6, 2, True, mode="capacity", capacity_factor=0.5, fit_budget=False)
    _, saved = layer.forward(*w, x)
    _, st = ref.forward(w, x, 2, True)
    routed = np.bincount(st["order"].ravel(), minlength=6)
    cap = int(np.ceil(0.5 * routed.sum() / 6))
    assert routed.max() > cap, "the case must drop pairs"
    np.testing.assert_array_equal(saved.expert_load, np.minimum(routed, cap))


@pytest.mark.parametrize("renormalize", [True, False])
def test_full_backward_is_exact(renormalize):
    rng = np.random.default_rng(1)
    w, x, dy = ref.random_layer(rng)
    layer = lrmoe.Layer(16, 24, 6, 2, renormalize, mode="full")
    y, saved = layer.forward(*w, x)
    y_ref, st = ref.forward(w, x, 2, renormalize)
    close(y, y_ref, "y")
    dx, grads, stats = layer.backward(*w, saved, dy)
    dx_ref, g_ref = ref.backward(w, st, dy, renormalize)
    close(dx, dx_ref, "dx")
    for name in ("router", "gate", "up", "down"):
        close(grads[name], g_ref[name], f"d{name}")
    assert stats["routed_pairs"] == 80 and stats["kept_pairs"] == 80
    assert stats["kept_fraction"] == 1.0
    assert saved.expert_load.sum() == 80
    np.testing.assert_array_equal(saved.expert_load, np.bincount(st["order"].ravel(), minlength=6))


def test_keep_projections_is_accepted_and_the_host_layer_stays_exact():
    # A device-executor setting: the host layer takes it and computes the
    # same exact backward (it recomputes its projections either way).
    rng = np.random.default_rng(2)
    w, x, dy = ref.random_layer(rng)
    plain = lrmoe.Layer(16, 24, 6, 2, True, mode="full")
    kept = lrmoe.Layer(16, 24, 6, 2, True, mode="full", keep_projections=True)
    assert kept.settings["keep_projections"] is True
    (y0, s0), (y1, s1) = plain.forward(*w, x), kept.forward(*w, x)
    np.testing.assert_array_equal(y0, y1)
    (dx0, g0, _), (dx1, g1, _) = plain.backward(*w, s0, dy), kept.backward(*w, s1, dy)
    np.testing.assert_array_equal(dx0, dx1)
    for name in ("router", "gate", "up", "down"):
        np.testing.assert_array_equal(g0[name], g1[name])
    with pytest.raises(ValueError, match="keep_projections"):
        lrmoe.Layer(16, 24, 6, 2, True, keep_projections="yes")


def test_lrmoe_keeps_the_best_pairs_and_their_gradients_only():
    rng = np.random.default_rng(2)
    w, x, dy = ref.random_layer(rng, tokens=64)
    layer = lrmoe.Layer(16, 24, 6, 2, True, mode="lrmoe", buffer_fraction=0.5,
                        selection_rule="top_q")
    y, saved = layer.forward(*w, x)
    dx, grads, stats = layer.backward(*w, saved, dy)
    kept = stats["kept"].reshape(64, 2)
    assert stats["kept_pairs"] == kept.sum()
    # The budget is half the call's pairs (rounded up).
    assert 0 < stats["kept_pairs"] <= 64
    assert stats["kept_fraction"] == pytest.approx(stats["kept_pairs"] / 128)
    _, st = ref.forward(w, x, 2)
    sc = ref.scores(st, dy)
    # Within each expert every kept pair scores at least every dropped one.
    for e in range(6):
        at = st["order"] == e
        k, d = sc[at & kept], sc[at & ~kept]
        if len(k) and len(d):
            assert k.min() >= d.max() * (1 - 1e-4), f"expert {e}"
    # The gradients are the kept pairs' (router: every pair's).
    dx_ref, g_ref = ref.backward(w, st, dy, kept=kept)
    close(dx, dx_ref, "dx")
    for name in ("router", "gate", "up", "down"):
        close(grads[name], g_ref[name], f"d{name}")


def test_priority_sampling_weights_are_unbiased_in_expectation_shape():
    rng = np.random.default_rng(3)
    w, x, dy = ref.random_layer(rng, tokens=64)
    layer = lrmoe.Layer(16, 24, 6, 2, True, mode="lrmoe", buffer_fraction=0.6)
    _, saved = layer.forward(*w, x)
    dx, grads, stats = layer.backward(*w, saved, dy)
    assert 0 < stats["kept_pairs"] < 128
    assert all(np.isfinite(v).all() for v in grads.values()) and np.isfinite(dx).all()


def test_bad_settings_and_shapes_are_one_line_errors():
    with pytest.raises(ValueError, match="buffer_fraction"):
        lrmoe.Layer(16, 24, 6, 2, True, buffer_fraction=1.5)
    with pytest.raises(ValueError, match="unknown field `bufer_fraction`"):
        lrmoe.Layer(16, 24, 6, 2, True, bufer_fraction=0.5)
    with pytest.raises(ValueError, match="selection_rule"):
        lrmoe.Layer(16, 24, 6, 2, True, selection_rule="best")
    with pytest.raises(ValueError, match="top_k"):
        lrmoe.Layer(16, 24, 6, 7, True)
    layer = lrmoe.Layer(16, 24, 6, 2, True)
    rng = np.random.default_rng(4)
    w, x, dy = ref.random_layer(rng)
    with pytest.raises(ValueError, match="gate"):
        layer.forward(w[0], w[1][:, :, :5], w[2], w[3], x)
    with pytest.raises(ValueError, match="x"):
        layer.forward(*w, x[:, :5])
    _, saved = layer.forward(*w, x)
    bad = dy.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite|NaN|finite"):
        layer.backward(*w, saved, bad)
    with pytest.raises(ValueError, match="dy"):
        layer.backward(*w, saved, dy[:5])
