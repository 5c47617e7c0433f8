"""Evaluation: tau sweeps and calibration (`sweep`), quality evaluators (`evaluators`) and stage
timeline plots (`timeline`)."""
