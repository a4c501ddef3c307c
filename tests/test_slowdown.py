"""Never slower, per request (``DrafterConfig.max_slowdown``, :class:`lookupdec.policy.Ledger`): a pass is drafted
only if, were every drafted token rejected, no request in it would have lost more than ``max_slowdown`` of its
plain decoding time (plus ``START_TOKENS`` tokens' worth) to drafts, its own or the other rows'.

The verdicts are about the drafter's accounts, priced with pass costs set by hand (no timings): the excess each
request ends with against plain decoding, when its drafts keep failing, and when it has nothing to copy beside a
row that drafts. Each is checked against the same run without the bound, which overdraws it.
"""

import numpy as np
import pytest
from helpers_costs import cpu_like, fixed_costs
from hypothesis import given, settings
from hypothesis import strategies as st

from lookupdec.drafter import Drafter, DrafterConfig, NoDrafts
from lookupdec.policy import START_TOKENS, Ledger, Offer, _band, best_batch_length, best_draft_length, token_lengths

BOUND = 0.05
TOKENS = 200


def _bounded(ledger: Ledger) -> bool:
    return ledger.excess <= BOUND * (ledger.produced + START_TOKENS) + 1e-9


def _drafter(max_slowdown=BOUND):
    # No per-pass bound in expectation (batch_slowdown): the ledger's bound alone.
    config = DrafterConfig(max_draft=16, use_cache=False, calibrate=False, batch_slowdown=float("inf"),
                           max_slowdown=max_slowdown)
    return fixed_costs(Drafter(config), cpu_like)


def _run(drafter, sessions, target, steps=TOKENS):
    """Drive ``sessions`` in passes of one length for all, as the batch loop does: ``target(row, position,
    draft)`` says what the target produces for that row after seeing ``draft``."""
    made = [0] * len(sessions)
    for _ in range(steps):
        drafts = drafter.propose(sessions, [16] * len(sessions))
        for row, (session, draft) in enumerate(zip(sessions, drafts)):
            tokens = target(row, made[row], draft)
            session.commit(tokens)
            made[row] += len(tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(1, 17)), max_size=60))
def test_a_ledger_that_only_takes_passes_within_its_room_stays_within_the_bound(passes):
    # The invariant that makes the bound hold: a pass is charged only where price - 1 <= room, and it produces at
    # least one token; the excess then never leaves max_slowdown * (produced + START_TOKENS).
    ledger = Ledger(BOUND)
    for price, produced in passes:
        price = 1.0 + min(price, ledger.room())
        ledger.charge(price)
        ledger.settle(produced)
        assert _bounded(ledger)
    assert Ledger(None).room() == float("inf")


def test_drafts_that_keep_failing_cost_a_request_at_most_the_bound():
    # A request whose every copy is wrong at its first token: a plain step's token each pass, whatever it drafts.
    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)  # copies everywhere
    ends = {}
    for bound in (BOUND, None):
        drafter = _drafter(bound)
        session = drafter.start(prompt)
        _run(drafter, [session], lambda row, position, draft: [int(draft[0]) + 1 if draft.size else 7])
        ends[bound] = session.ledger
    assert _bounded(ends[BOUND]) and ends[BOUND].produced == TOKENS
    # Without the bound the same request loses more: this is what the test would see if the bound were ignored.
    assert ends[None].excess > BOUND * (ends[None].produced + START_TOKENS)


def test_a_request_with_nothing_to_copy_pays_at_most_the_bound_for_the_others_drafts():
    # Row 0 copies (every draft accepted), row 1 has nothing to copy (plain decoding, "lookup": false); one pass
    # serves both, as wide as row 0's draft, priced per row by the batch's cost.
    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)
    ends, gained = {}, {}
    for bound in (BOUND, None):
        drafter = _drafter(bound)
        copying, plain = drafter.start(prompt), NoDrafts(bound)

        def target(row, position, draft):
            if row == 1:
                return [5]
            accepted = [int(t) for t in draft]
            return accepted + [int(prompt[(position + len(accepted)) % 20 + 10])]

        _run(drafter, [copying, plain], target, steps=100)
        ends[bound], gained[bound] = plain.ledger, copying.ledger.produced
    assert _bounded(ends[BOUND])
    assert ends[None].excess > BOUND * (ends[None].produced + START_TOKENS)
    # The copying row still drafts, within what the other row's room allows (on this CPU-like cost, a pass costs
    # 0.35 plain steps more than a plain one however short its draft): far less than without the bound.
    assert 110 < gained[BOUND] < gained[None]


def test_copy_heavy_text_keeps_its_drafts():
    # Drafts that pay refill the room: once its first short probe is accepted, a request copying correctly drafts
    # as long as it would without the bound. What the bound costs it is that start, a few passes, not a share.
    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)
    per_pass = {}
    for bound in (BOUND, None):
        drafter = _drafter(bound)
        session = drafter.start(prompt)
        passes = per_pass[bound] = []

        def target(row, position, draft):
            passes.append(draft.size + 1)
            return [int(t) for t in draft] + [int(prompt[(position + draft.size) % 20 + 10])]

        _run(drafter, [session], target, steps=60)
    assert sum(per_pass[None][-40:]) >= 40 * 16  # drafts of 16, kept
    assert sum(per_pass[BOUND][-40:]) >= 40 * 16, per_pass[BOUND]
    assert sum(per_pass[BOUND]) >= sum(per_pass[None]) - 4 * 17, per_pass[BOUND][:8]  # a start of a few passes


def test_the_length_rules_respect_the_room():
    sure = Offer(np.zeros(16, dtype=np.int32), 0.95, 0.95)
    costs = np.array(cpu_like(16))  # 1, 1.35, 1.4, ...
    assert best_draft_length(0.95, 0.95, costs) == 16
    assert best_draft_length(0.95, 0.95, costs, room=0.5) == 4  # costs[4] = 1.5: the longest within the room
    assert best_draft_length(0.95, 0.95, costs, room=0.3) == 0
    tight = Offer(np.zeros(0, dtype=np.int32), 0.0, 0.0, room=0.5)
    assert best_batch_length([sure, tight], costs) <= 4 and best_batch_length([sure, tight], costs) > 0
    assert best_batch_length([sure], costs) == 16
    assert sum(token_lengths([sure, tight], 1.0, 0.1)) <= 5  # 1 + 0.1 * 5 tokens = 1.5 of a 2-token... step
    assert sum(token_lengths([sure], 1.0, 0.1)) > 5


def test_bad_bounds_are_refused():
    for bad in (-0.1, float("inf"), True, "0.05"):
        with pytest.raises(ValueError, match="max_slowdown must be a number >= 0 or None"):
            DrafterConfig(max_slowdown=bad)


@pytest.mark.parametrize("given, expected", [([], 0.05), (["--max-slowdown", "none"], None),
                                             (["--max-slowdown", "0.2"], 0.2)])
def test_lookupdec_serve_takes_the_bound_on_both_engines(monkeypatch, given, expected):
    from click.testing import CliRunner

    from lookupdec import cli
    from lookupdec.serve import run as serve_run
    from lookupdec.vllm import launch

    seen = []
    monkeypatch.setattr(serve_run, "serve", lambda options, say: seen.append(options.max_slowdown))
    monkeypatch.setattr(launch, "run", lambda options, say: seen.append(options.proposer.max_slowdown) or 0)
    for engine in ("transformers", "vllm"):
        result = CliRunner().invoke(cli.main, ["serve", "--engine", engine, *given], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    assert seen == [expected, expected]


def test_a_bad_bound_is_a_usage_error():
    from click.testing import CliRunner

    from lookupdec import cli

    result = CliRunner().invoke(cli.main, ["serve", "--max-slowdown", "-1"])
    assert result.exit_code == 2 and "'-1' is not a fraction >= 0 or none" in result.output


def test_a_request_alone_is_charged_what_its_drafted_passes_took():
    # The profile prices a drafted pass at 1.01-1.16 plain steps; it takes 1.2 (inside the refinement's dead band,
    # so the price stays). Every draft is rejected. The ledger charges what the passes took, so the request's
    # time against plain decoding, counted from the clock, stays within the bound (plus one pass's overshoot).
    from helpers_costs import nearly_free

    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)
    plain_step, drafted_pass = 0.01, 0.012
    config = DrafterConfig(max_draft=16, use_cache=False, calibrate=False, max_slowdown=BOUND)
    drafter = Drafter(config)
    drafter.cost.use_profile(nearly_free(16), refine=True)
    session = drafter.start(prompt)
    lost = drafts = 0
    for _ in range(TOKENS):
        (draft,) = drafter.propose([session], [16])
        seconds = drafted_pass if draft.size else plain_step
        session.commit([int(draft[0]) + 1 if draft.size else 7], seconds)
        lost += seconds / plain_step - 1
        drafts += bool(draft.size)
    assert drafts >= 5  # it probed, and went on probing as its room grew
    assert session.ledger.excess == pytest.approx(lost, abs=0.05)
    assert lost <= BOUND * (TOKENS + START_TOKENS) + 0.2


def test_a_row_of_a_batch_is_charged_what_the_drafted_passes_took():
    # Two rows: one drafts and every draft is rejected, one has nothing to copy ("lookup": false). The batch's
    # profile prices a drafted pass at 1.01-1.16 plain steps of two rows; it takes 1.2 (inside the refinement's
    # dead band, so the price stays), as on a CPU where a bucket's profile underprices the passes run. Both rows
    # are charged what the passes took, so the row without drafts loses, counted from the clock, at most the bound
    # (plus one pass's overshoot).
    from helpers_costs import nearly_free

    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)
    plain_step, drafted_pass = 0.02, 0.024
    config = DrafterConfig(max_draft=16, use_cache=False, calibrate=False, max_slowdown=BOUND)
    drafter = Drafter(config)
    drafter.batch_cost(2).use_profile(nearly_free(16), refine=True)
    drafting, plain = drafter.start(prompt), NoDrafts(BOUND)
    lost = drafts = 0
    for _ in range(TOKENS):
        drafts_ = drafter.propose([drafting, plain], [16, 16])
        width = max(draft.size for draft in drafts_)
        seconds = drafted_pass if width else plain_step
        drafter.observe(2, width, seconds, [drafting, plain])  # as BatchRun reports its pass, before the commits
        drafting.commit([int(drafts_[0][0]) + 1 if width else 7])
        plain.commit([5])
        lost += seconds / plain_step - 1
        drafts += bool(width)
    assert drafts >= 5
    assert plain.ledger.excess == pytest.approx(lost, abs=0.05)
    assert lost <= BOUND * (TOKENS + START_TOKENS) + 0.2


def test_a_pass_run_before_a_plain_step_of_its_size_is_charged_once_one_is():
    from lookupdec.policy import PlainSteps

    steps = PlainSteps()
    steps.observe(4, 0.1)  # 4 rows' plain steps are known, 3 rows' not yet
    ledger = Ledger(BOUND)
    for _ in range(2):  # two drafted passes of 3 rows: not measured against a plain step of 4
        ledger.charge(1.2)
        ledger.timed(0.3, 3, steps)
        ledger.settle(1)
    assert ledger.excess == pytest.approx(0.4)
    assert len(ledger.untimed) == 1  # one record per batch size, however many passes wait
    ledger.timed(None, 4, steps)  # a plain step of 4 rows says nothing about them
    ledger.settle(1)
    assert ledger.excess == pytest.approx(0.4)
    steps.observe(3, 0.075)
    ledger.timed(None, 3, steps)
    ledger.settle(1)
    assert ledger.excess == pytest.approx(0.4 + 2 * (0.3 / 0.075 - 1.2))
    assert not ledger.untimed


def test_a_bucket_profile_is_priced_for_a_smaller_batch_by_their_plain_steps():
    # Batches of 3 rows are priced with the profile of 4 (their bucket), measured against a plain step of 4 rows.
    # Where a plain step of 3 rows is cheaper, a drafted pass is priced up by the ratio, not below a pass of 4.
    from helpers_costs import nearly_free

    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)
    config = DrafterConfig(max_draft=16, use_cache=False, calibrate=False, max_slowdown=None,
                           batch_slowdown=float("inf"))
    profile = np.array(nearly_free(16))

    def price(rows, timings):
        drafter = Drafter(config)
        drafter.batch_cost(4).use_profile(profile)
        for size, seconds in timings:
            drafter.plain_steps.observe(size, seconds)
        sessions = [drafter.start(prompt) for _ in range(rows)]
        for session in sessions:  # past the prompt's copy of itself, so that every row drafts
            session.commit([10, 11, 12, 13])
        drafts = drafter.propose(sessions, [8] * rows)
        assert drafts[0].size
        return sessions[0].ledger.price, profile[drafts[0].size]

    timed = [(4, 0.1), (3, 0.075)]
    charged, listed = price(3, timed)
    assert charged == pytest.approx(listed * 0.1 / 0.075)
    assert price(4, timed)[0] == pytest.approx(price(4, timed)[1])  # the bucket's own size: its profile
    assert price(3, [(4, 0.1)])[0] == pytest.approx(price(3, [(4, 0.1)])[1])  # 3 rows' step not timed yet
    assert price(3, [(4, 0.1), (3, 0.12)])[0] == pytest.approx(price(3, [(4, 0.1), (3, 0.12)])[1])  # never cheaper


def test_the_cost_models_probes_stay_within_the_room_but_one_token():
    # A refined profile where no draft pays (each drafted token a full step), priced right, every draft rejected:
    # the policy never drafts, so every draft run is the refinement's probe. The first, with no room yet, is one
    # token; the longer bands wait until the request's room affords them. Probing the longest candidate at once
    # (16 tokens, 17 steps) would cost this request 16 steps in its first pass.
    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)
    plain_step = 0.01
    profile = [1.0 + d for d in range(17)]
    config = DrafterConfig(max_draft=16, use_cache=False, calibrate=False, max_slowdown=BOUND)
    drafter = Drafter(config)
    drafter.cost.use_profile(profile, refine=True)
    session = drafter.start(prompt)
    probes = []
    for _ in range(TOKENS):
        room = session.ledger.room()
        (draft,) = drafter.propose([session], [16])
        if draft.size:
            probes.append(draft.size)
            assert draft.size == 1 or profile[draft.size] - 1 <= room + 1e-9, (probes, room)
            # ... and the longest such: no longer length of a band not yet probed fitted the room.
            probed = {_band(d) for d in probes}
            assert all(profile[d] - 1 > room for d in range(draft.size + 1, 17) if _band(d) not in probed), probes
        session.commit([int(draft[0]) + 1 if draft.size else 7], plain_step * profile[draft.size])
    assert probes[0] == 1 and len(probes) >= 2 and max(probes) > 1, probes  # longer bands, once affordable
    assert len(probes) == len({_band(d) for d in probes})  # at most one pass per band
    assert session.ledger.excess <= BOUND * (TOKENS + START_TOKENS) + profile[1] - 1


def test_a_probe_is_handed_out_once_per_band_as_the_pass_is_run():
    from lookupdec.policy import Refinement, padded_width

    costs = np.array([1.0 + d for d in range(17)])  # each drafted token a full step: no draft pays
    refinement = Refinement()
    assert refinement.probe(0, costs, 100.0) == 0  # no plain step timed yet
    refinement.observe(0, 0.01, 1.0)
    assert refinement.probe(3, costs, 100.0) == 3  # the policy drafts: no probe
    assert refinement.probe(0, costs, 5.0) == 5  # the longest the room affords (band 4-7)
    assert refinement.probe(0, costs, 5.0) == 3  # band 4-7 is handed out until its pass is observed
    assert refinement.probe(0, costs, 0.5) == 1  # the room affords none: one token
    assert refinement.probe(0, costs, 0.5) == 0
    refinement.observe(5, 0.06, 6.0)
    assert refinement.probe(0, costs[:8], 100.0) == 2  # band 4-7 was run; 3 and 1 are still handed out
    # Padded passes (a static cache): a refinement sees a pass of 2 drafted tokens as the padded width 3, so
    # the band of 2 is never observed and must not be probed again and again.
    padded = Refinement()
    padded.observe(0, 0.01, 1.0)
    padded.observe(3, 0.04, 4.0)
    runs = [padded_width(d + 1, (1, 2, 4, 8)) - 1 for d in range(4)]  # 0, 1, 3, 3
    assert padded.probe(0, costs[:4], 100.0, runs) == 1
    padded.observe(1, 0.02, 2.0)
    assert [padded.probe(0, costs[:4], 100.0, runs) for _ in range(3)] == [0, 0, 0]


def test_a_batch_probes_no_wider_than_the_guard_lets_a_pass_cost_a_row(monkeypatch):
    # Throughput first (no ledger), the policy finding no draft that pays: every draft run is the refinement's
    # probe. In a batch each row pays the probe's width, so a probe costs at most batch_slowdown of a step (else
    # one token), not the longest band on offer: unbounded, a fresh profile's 8-row probes ran 64 tokens wide.
    import lookupdec.drafter

    monkeypatch.setattr(lookupdec.drafter, "best_batch_length", lambda *args, **kwargs: 0)
    prompt = np.tile(np.arange(10, 30, dtype=np.int32), 5)
    config = DrafterConfig(max_draft=16, use_cache=False, calibrate=False, max_slowdown=None, batch_slowdown=0.2)
    drafter = Drafter(config)
    drafter.batch_cost(4).use_profile([1.0 + 0.1 * d for d in range(17)], refine=True)  # d tokens: 1 + d/10
    drafter.observe(4, 0, 0.01)  # a plain step timed: probes may start
    sessions = [drafter.start(prompt) for _ in range(4)]
    for session in sessions:  # past the prompt's copy of itself, so that every row has 16 tokens on offer
        session.commit([10, 11, 12, 13])
    widths = [max(draft.size for draft in drafter.propose(sessions, [16] * 4)) for _ in range(3)]
    assert widths == [2, 1, 0]  # bands 2 then 1 (1.2 and 1.1 steps), each handed out once; 3+ cost more
