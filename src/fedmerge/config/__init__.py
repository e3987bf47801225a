"""The experiment config: its validated schema, overrides and loading, the component catalog, tuned values."""
