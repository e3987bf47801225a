"""Many runs: the sweep spec, the subprocess launcher, its progress display, and Optuna tuning."""
