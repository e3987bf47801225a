"""Experiment layer: validated config, runner, results store, reports."""
