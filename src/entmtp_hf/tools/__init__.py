"""Offline tools (extra ``[tools]``): search, bench, profile, regime, calibration, training, data."""
