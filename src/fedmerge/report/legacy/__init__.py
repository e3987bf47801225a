"""The first small-scale reproductions' report writers, superseded by ``fedmerge study`` and kept so that the
archived reports (docs/reproductions/archive/) can be made again. Each runs from the repository root:

    python -m fedmerge.report.legacy.livar_report [CONFIG] [key=value ...]
    python -m fedmerge.report.legacy.superfed_report [CONFIG] [key=value ...]
    python -m fedmerge.report.legacy.superfed_ablation [CONFIG] [key=value ...]
    python -m fedmerge.report.legacy.foundation_report [key=value ...]
    python -m fedmerge.report.legacy.fedmerge_report --setting TITLE=BASE_CONFIG:RUNS_DIR [...]

and writes under ``runs/legacy-reports/``, never into ``docs/``. The files they write name the scripts they
were (``scripts/NAME.py``, which still run them), so a report made again is the same file.
"""
