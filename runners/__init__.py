"""The deterministic runner: Beam graphs executed per lane with ordered watermarks."""
