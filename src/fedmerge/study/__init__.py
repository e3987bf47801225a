"""The reproduction protocol: study specs, the regime check, selection, and the study report."""
