"""Fitting the sim's step time to a real engine (`vtoken calibrate`) and checking it (`vtoken validate`).

    model.py    StepTimeModel: overhead + coefficients x the step features the runtime counts
    fit.py      non-negative least squares over measured steps, and the fit's error per kind of step
    profile.py  the sim profile TOML a calibration writes (and `load_sim_profile` reads back)
    grid.py     the designed grid of steps a calibration measures
    vllm_steps.py, hf_steps.py   timing those steps on each engine
"""
