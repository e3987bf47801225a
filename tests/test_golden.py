"""The golden-file comparison of tests/golden.py: integers exact, floats within float32 rounding."""

from golden import in_order_close, json_close, line_close


def test_a_float32_difference_from_another_cpu_passes_and_a_real_change_fails():
    assert json_close({"test_ece": 0.2980247684, "n": 12}, {"test_ece": 0.2980247654, "n": 12})
    assert not json_close({"test_ece": 0.2990247684, "n": 12}, {"test_ece": 0.2980247654, "n": 12})
    assert not json_close({"test_ece": 0.2980247654, "n": 13}, {"test_ece": 0.2980247654, "n": 12})
    assert not json_close({"a": 1.0}, {"a": 1.0, "b": 2})


def test_printed_figures_may_round_the_other_way_but_counts_never_differ():
    assert line_close("| FedAvg | 71.3 | 5 runs |", "| FedAvg | 71.2 | 5 runs |")  # one unit of the last digit
    assert not line_close("| FedAvg | 71.4 | 5 runs |", "| FedAvg | 71.2 | 5 runs |")
    assert not line_close("| FedAvg | 71.2 | 6 runs |", "| FedAvg | 71.2 | 5 runs |")
    assert not line_close("| FedProx | 71.2 | 5 runs |", "| FedAvg | 71.2 | 5 runs |")
    assert in_order_close(["a 1.00", "b 2"], ["a 1.01", "x", "b 2"])
    assert not in_order_close(["b 2", "a 1"], ["a 1", "b 2"])
