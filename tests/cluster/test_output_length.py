"""What the router charges a request for its output: the expected length learned from finished
requests, never more than the request's own ``max_tokens`` (not the whole remaining context)."""

import pytest

from cluster.routing.output_length import OutputLengthEstimate, router_charge


def test_a_request_without_max_tokens_is_not_charged_the_whole_context():
    """Before: prompt + (context - prompt), which pushed every group over the target."""
    lengths = OutputLengthEstimate(prior_tokens=256)
    assert router_charge(100, n=1, max_tokens=1948, lengths=lengths) == 100 + 256


def test_the_expected_length_is_learned_from_finished_requests():
    lengths = OutputLengthEstimate(prior_tokens=256, min_samples=8, quantile=0.75)
    for length in [10, 20, 30, 40, 50, 60, 70, 80]:
        lengths.record(length)
    assert lengths.expected(10_000) == 60  # the 75th percentile
    assert router_charge(100, n=3, max_tokens=1948, lengths=lengths) == 100 + 3 * 60


def test_max_tokens_bounds_the_charge_and_the_prior_holds_until_enough_samples():
    lengths = OutputLengthEstimate(prior_tokens=256, min_samples=4)
    assert lengths.expected(16) == 16
    lengths.record(1000)
    assert lengths.expected(10_000) == 256  # one sample is not enough to trust
    for _ in range(3):
        lengths.record(1000)
    assert lengths.expected(10_000) == 1000


def test_old_samples_leave_the_window():
    lengths = OutputLengthEstimate(prior_tokens=5, window=4, min_samples=2, quantile=0.5)
    for length in [900, 900, 900, 900, 10, 10, 10, 10]:
        lengths.record(length)
    assert lengths.expected(10_000) == 10


def test_bad_settings_name_themselves():
    with pytest.raises(ValueError, match="quantile"):
        OutputLengthEstimate(quantile=1.5)
    with pytest.raises(ValueError, match="prior_tokens"):
        OutputLengthEstimate(prior_tokens=0)
