"""The cases ported from XLA's partitioner tests (tests/xla_cases.py): each equals one
device on both backends and communicates no more than asserted."""
import pytest
from util import BYTES_RECEIVED, check
from xla_cases import CASES, Case


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_ported_xla_case(case: Case):
    # Priced by the bytes each device receives: these arrays are small, and on a real
    # network's latencies fewer, larger collectives would win; the strategies pay off in bandwidth.
    report = check(case.fn, *case.arguments(), hardware=BYTES_RECEIVED).report()
    counts = dict(report.counts())
    if case.kinds is not None:
        assert counts == case.kinds, str(report)
    if case.most is not None:
        assert len(report.collectives) <= case.most, str(report)
    assert not set(counts) & set(case.forbid), str(report)
    if case.below is not None:
        assert all(c.bytes < case.below for c in report.collectives), str(report)
    if case.total is not None:
        assert report.collective_bytes <= case.total, str(report)
    assert case.fallback or not report.fallbacks, str(report)


def test_enough_cases_are_ported():
    assert len(CASES) >= 80
    assert len({c.name for c in CASES}) == len(CASES)
