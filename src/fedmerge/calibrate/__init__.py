"""Calibration runs that produce inputs of a method (LIVAR's G_SHAP table)."""
