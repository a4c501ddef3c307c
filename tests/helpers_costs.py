"""Pass costs set by hand, for tests whose verdict depends on which drafts pay.

A drafter that measures its pass cost (``lookupdec.calibrate``) prices drafts with this machine's timings, and one
that does not (``calibrate=False``) fits a straight line to the passes it runs, timed too: on a slow or busy
machine either drafts less, or nothing. A test that asserts that drafts were made, accepted, rejected or padded
sets the costs by hand, so that its verdict is a statement about the drafts, not about the machine. A profile set
by hand is neither measured again nor corrected from the passes' timings.

``conftest.py``'s ``LOOKUPDEC_TEST_PASS_COSTS=dear|cheap`` prices every measured or timed pass far too dear or
far too cheap, to find the tests that still depend on timings.
"""

# Single rows and the batch buckets the tests run (Drafter.batch_rows: powers of two).
_ROWS = (1, 2, 4, 8, 16)


def cpu_like(max_draft: int) -> list:
    """A CPU-like profile: a drafted pass costs 1.3 plain steps plus 5% of a step per drafted token."""
    return [1.0] + [1.3 + 0.05 * d for d in range(1, max_draft + 1)]


def nearly_free(max_draft: int) -> list:
    """Verification nearly free (an accelerator's short drafts): a draft wherever there is a candidate."""
    return [1.0] + [1.0 + 0.01 * d for d in range(1, max_draft + 1)]


def fixed_costs(drafter, curve=cpu_like):
    """``drafter`` with ``curve(max_draft)`` as its pass cost for one row and for every batch size; returned."""
    profile = curve(drafter.drafter_config.max_draft)
    for rows in _ROWS:
        drafter.batch_cost(rows).use_profile(profile)
    return drafter
