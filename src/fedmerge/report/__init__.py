"""Reading run folders back: comparison tables, the HTML report and the figures."""
