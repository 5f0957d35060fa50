"""The step-time model, its NNLS fit and the calibrated sim profile."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.calibration.fit import MeasuredStep, fit_step_model, nnls_relative
from vtoken.calibration.model import FEATURES, Provenance, StepTimeModel, step_features
from vtoken.engine.executor import ChunkLoad, StepLoad, copy_load, prefill_kv_pairs
from vtoken.errors import ConfigError

TRUE = StepTimeModel(overhead_s=4e-3, per_decode_token_s=2.5e-3, per_kv_slot_s=3e-7, per_prefill_token_s=1.2e-3,
                     per_prefill_request_s=1e-3, per_prefill_kv_pair_s=2e-7, per_copied_token_s=5e-7)


def decode(num_requests: int, context: int) -> StepLoad:
    return StepLoad(num_requests * context, num_requests * context, num_requests, (), 0)


def prefill(prompts: list[int], num_decodes: int = 0, context: int = 0) -> StepLoad:
    return StepLoad(num_decodes * context, num_decodes * context, num_decodes, tuple(ChunkLoad(0, 0, p) for p in prompts), 0)


def grid_steps(model: StepTimeModel, noise: float, seed: int = 0) -> list[MeasuredStep]:
    rng = np.random.default_rng(seed)
    loads = [("decode", decode(b, c)) for b in (1, 2, 4, 8) for c in (64, 256, 1024)]
    loads += [("prefill", prefill([p])) for p in (32, 128, 512, 1024)] + [("prefill", prefill([256, 256]))]
    loads += [("mixed", prefill([p], b, 256)) for p in (64, 512) for b in (2, 8)]
    loads += [("copy", copy_load(n)) for n in (32, 256, 2048)]
    steps = []
    for _ in range(3):
        for kind, load in loads:
            exact = model.copy_time_s(load.num_copied_tokens) if kind == "copy" else model.forward_time_s(load)
            steps.append(MeasuredStep(kind, load, exact * (1 + noise * rng.standard_normal())))
    return steps


def test_features_count_one_step():
    # 3 decodes reading 300 slots (240 live), a 4-token chunk after 6 cached slots (5 live), a new 2-token prompt
    load = StepLoad(300, 240, 3, (ChunkLoad(6, 5, 4), ChunkLoad(0, 0, 2)), 0)
    assert step_features(load).tolist() == [1, 3, 300, 6, 2, 4 * 6 + 10 + 3]
    assert step_features(load, reads_extent=False).tolist() == [1, 3, 240, 6, 2, 4 * 5 + 10 + 3]
    assert prefill_kv_pairs(0, 4) == 10 and prefill_kv_pairs(6, 2) == 15
    assert step_features(copy_load(64)).tolist() == [0, 0, 0, 0, 0, 0]


def test_fit_recovers_known_coefficients_without_noise():
    fit = fit_step_model(grid_steps(TRUE, noise=0.0))
    np.testing.assert_allclose(fit.model.coefficients, TRUE.coefficients, rtol=1e-6)
    assert fit.model.per_copied_token_s == pytest.approx(TRUE.per_copied_token_s, rel=1e-9)
    assert all(e.max_abs_rel_error < 1e-6 for e in fit.errors.values())


def test_fit_recovers_known_coefficients_with_noise():
    fit = fit_step_model(grid_steps(TRUE, noise=0.02, seed=1))
    # the terms that carry most of the time come back within a few percent
    for name in ("overhead_s", "per_decode_token_s", "per_prefill_token_s", "per_prefill_kv_pair_s"):
        assert getattr(fit.model, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    assert fit.model.per_copied_token_s == pytest.approx(TRUE.per_copied_token_s, rel=0.05)
    assert set(fit.errors) == {"decode", "prefill", "mixed", "copy"}
    assert all(e.mean_abs_rel_error < 0.05 for e in fit.errors.values())
    assert fit.errors["decode"].num_steps == 36


def test_fit_never_gives_a_negative_coefficient():
    # times that fall with the batch: least squares would give a negative per-token price
    steps = [MeasuredStep("decode", decode(b, 64), 0.01 / b) for b in (1, 2, 4, 8, 16, 32, 64)]
    fit = fit_step_model(steps)
    assert np.all(fit.model.coefficients >= 0)
    assert len(FEATURES) == fit.model.coefficients.size


def test_fit_needs_enough_steps():
    with pytest.raises(ConfigError, match="cannot fit"):
        fit_step_model(grid_steps(TRUE, 0.0)[:3])


def test_nnls_minimises_error_relative_to_the_model():
    x = np.array([[1.0], [1.0], [4.0]])
    y = np.array([1.0, 3.0, 8.0])
    # repeats of one load come back at their mean (weights 1 / measured would give 1.2 for the first two)
    assert nnls_relative(x[:2], y[:2])[0] == pytest.approx(2.0)
    # and the solution is the fixed point: sum_i x_i (x_i c - y_i) / (x_i c)^2 = 0
    c = nnls_relative(x, y)[0]
    assert np.sum(x[:, 0] * (x[:, 0] * c - y) / (x[:, 0] * c) ** 2) == pytest.approx(0.0, abs=1e-9)


def test_fit_is_unbiased_under_skewed_noise():
    # steps that sometimes run slow (lognormal noise, mean 1): the fitted steps' total is the measured
    # total, where weights 1 / measured would fit it low by about sigma^2 (4% here)
    rng = np.random.default_rng(3)
    loads = [decode(b, c) for b in (1, 2, 4, 8) for c in (64, 512)] + [prefill([p]) for p in (64, 256, 1024)]
    sigma = 0.2
    steps = [MeasuredStep("prefill" if load.prefill_chunks else "decode", load,
                          TRUE.forward_time_s(load) * rng.lognormal(-sigma**2 / 2, sigma))
             for _ in range(200) for load in loads]
    fit = fit_step_model(steps)
    measured, predicted = sum(s.measured_s for s in steps), sum(fit.predicted_s)
    assert predicted / measured == pytest.approx(1.0, abs=0.01)
    x = np.stack([step_features(s.load) for s in steps])
    y = np.array([s.measured_s for s in steps])
    naive = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]  # weights 1 / measured
    assert (x @ naive).sum() / measured < 0.98


PROVENANCE = Provenance("vllm", "SmolLM2-135M-Instruct", "AMD EPYC \"x\"", 2, "2.13.0+cpu", "0.32.0", "cpu",
                        "2026-12-01T12:00:00+00:00")


def calibrated_profile():
    from vtoken.calibration.grid import CalibrationGrid
    from vtoken.calibration.profile import CalibrationProfile
    from vtoken.engine.sim import SimProfile

    fit = fit_step_model(grid_steps(TRUE, noise=0.01), PROVENANCE)
    sim = SimProfile(sync_copy=True, step_model=fit.model)
    return CalibrationProfile(sim, CalibrationGrid(num_rounds=2), {"block_size": 32, "max_num_batched_tokens": 4096},
                              fit.errors, 60)


def test_profile_round_trips_through_toml(tmp_path):
    from vtoken.calibration.profile import load_calibration, profile_to_toml
    from vtoken.engine.sim import load_sim_profile

    profile = calibrated_profile()
    path = tmp_path / "profile.toml"
    path.write_text(profile_to_toml(profile))
    assert load_sim_profile(path) == profile.sim  # what --sim-profile reads: every coefficient, bit for bit
    assert load_calibration(path) == profile
    assert load_sim_profile(path).describe_step_times().startswith("calibrated against vllm SmolLM2-135M-Instruct")


def test_sim_costs_steps_with_the_fitted_model():
    from vtoken.engine.sim import SimExecutor, SimProfile
    from vtoken.hardware import resolve_gpu
    from vtoken.model_spec import resolve_model

    load = StepLoad(900, 600, 4, (ChunkLoad(0, 0, 128),), 256)
    model, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("a100-80gb")
    fitted = SimExecutor(model, gpu, SimProfile(sync_copy=True, step_model=TRUE), 0)
    assert fitted.iteration_time_s(load) == pytest.approx(TRUE.forward_time_s(load) + 256 * TRUE.per_copied_token_s)
    # the gather kernel reads live tokens: 300 fewer slots
    gather = SimExecutor(model, gpu, SimProfile(sync_copy=True, step_model=TRUE, attention_reads="live-tokens"), 0)
    assert fitted.iteration_time_s(load) - gather.iteration_time_s(load) == pytest.approx(300 * TRUE.per_kv_slot_s)
    hidden = SimExecutor(model, gpu, SimProfile(copy_overlap_s=1.0, step_model=TRUE), 0)
    assert hidden.iteration_time_s(load) == pytest.approx(TRUE.forward_time_s(load))
    assert SimProfile().describe_step_times() == "catalog roofline estimates (not calibrated)"


def test_profile_errors_name_the_file(tmp_path):
    from vtoken.calibration.profile import load_calibration
    from vtoken.engine.sim import load_sim_profile

    bad = tmp_path / "bad.toml"
    bad.write_text("[sim.step_model]\noverhead_s = 0.1\n")
    with pytest.raises(ConfigError, match=r"bad.toml: step_model is missing 'per_decode_token_s'"):
        load_sim_profile(bad)
    bad.write_text("[sim.step_model]\noverhead_s = -1.0\n" + "".join(f"{n} = 0.0\n" for n in FEATURES[1:])
                   + "per_copied_token_s = 0.0\n")
    with pytest.raises(ConfigError, match="overhead_s must be a number >= 0"):
        load_sim_profile(bad)
    plain = tmp_path / "plain.toml"
    plain.write_text("mfu = 0.4\n")
    with pytest.raises(ConfigError, match="plain.toml: not a calibrated profile"):
        load_calibration(plain)


def test_a_profile_s_grid_is_its_calibration_record(tmp_path):
    from vtoken.calibration.profile import calibration_grid, profile_to_toml

    profile = calibrated_profile()
    path = tmp_path / "profile.toml"
    path.write_text(profile_to_toml(profile))
    assert calibration_grid(path) == profile.grid
    hand_written = tmp_path / "hand.toml"
    hand_written.write_text("[sim.step_model]\n" + "".join(f"{n} = 0.001\n" for n in FEATURES)
                            + "per_copied_token_s = 0.0\n")
    assert calibration_grid(hand_written) is None
    path.write_text(profile_to_toml(profile).replace("[calibration.grid]", "[calibration.gridx]"))
    with pytest.raises(ConfigError, match="incomplete or malformed"):
        calibration_grid(path)
