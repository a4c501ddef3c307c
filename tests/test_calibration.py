"""The pass-cost profile: measured once per model, device and thread count, cached on disk, used by the drafter."""

import json

import numpy as np
import pytest
import torch

import lookupdec
from lookupdec import LookupDrafter
from lookupdec import calibration as cal
from lookupdec.drafter import DrafterConfig


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "cache_dir", lambda: tmp_path)
    return tmp_path / "costs"


def test_measured_profile_is_relative_to_a_plain_step_and_leaves_the_global_rng_alone(tiny_factory):
    model = tiny_factory("llama")
    state = torch.get_rng_state()
    profile = cal.measure_pass_costs(model, max_draft=12, rounds=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert profile.shape == (13,) and profile[0] == 1.0  # relative to a plain step
    assert np.all(np.isfinite(profile)) and profile.min() > 0
    with pytest.raises(ValueError, match="rounds >= 1"):
        cal.measure_pass_costs(model, max_draft=12, rounds=0)


def test_lengths_are_dense_for_short_drafts_and_sparse_beyond():
    assert cal._lengths(3) == [0, 1, 2, 3]
    assert cal._lengths(5) == [0, 1, 2, 3, 4, 5]
    assert cal._lengths(32) == [0, 1, 2, 3, 4, 8, 16, 32]
    assert cal._lengths(30) == [0, 1, 2, 3, 4, 8, 16, 30]
    assert cal._lengths(64) == [0, 1, 2, 3, 4, 8, 16, 32, 64]
    assert cal._lengths(100)[-3:] == [64, 96, 100]


def test_a_length_past_the_jagged_part_is_capped_by_the_longer_ones():
    # Up to SHORT the curve may fall (a CPU's 3-row product can be cheaper than its 2-row one): kept as measured.
    # Past it, a time dearer than a longer length's caught interference in its one round: lowered to that time.
    lengths = [0, 1, 2, 3, 4, 8, 16, 32]
    assert cal.SHORT == 3
    got = cal._capped(lengths, np.array([1.0, 1.8, 2.0, 1.4, 2.9, 1.9, 2.2, 3.0]))
    assert got.tolist() == [1.0, 1.8, 2.0, 1.4, 1.9, 1.9, 2.2, 3.0]


def test_batches_are_calibrated_per_size_bucket(tiny_factory, cache_dir):
    # A batch's pass cost is measured for its starting size's bucket (the next power of two), in files of their
    # own, and drafts of up to BATCH_DRAFT; one row keeps the single-row profile.
    model = tiny_factory("llama")
    drafter = LookupDrafter()
    assert [drafter.batch_rows(r) for r in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    prompts = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7], [9, 8, 7, 6, 9, 8, 7, 6], [1, 4, 5, 6, 1, 4, 5, 6]])
    lookupdec.generate(model, prompts, torch.ones_like(prompts), max_new_tokens=4, drafter=drafter)
    four = drafter.batch_cost(3)
    assert four is drafter.batch_cost(4) and four.profile_source is model
    assert four.profile.size == cal.BATCH_DRAFT + 1 and four.profile[0] == 1.0
    assert drafter.cost.profile_source is model and drafter.batch_cost(2).profile is None  # not run: not measured
    assert sorted(p.name.endswith("-rows4.json") for p in cache_dir.glob("*.json")) == [False, True]


def test_the_profile_is_cached_on_disk_and_measured_again_when_asked(tiny_factory, cache_dir, monkeypatch):
    model = tiny_factory("gpt2")
    calls = []

    def fake_measure(model, max_draft=32, **kw):
        calls.append(max_draft)
        return np.linspace(1.0, 2.0 + len(calls), max_draft + 1)

    monkeypatch.setattr(cal, "measure_pass_costs", fake_measure)
    first = cal.pass_costs(model, 8)
    assert calls == [8] and first[-1] == 3.0
    (path,) = cache_dir.glob("*.json")
    assert json.loads(path.read_text())["profile"] == pytest.approx(first.tolist())
    assert sorted(p.name for p in cache_dir.iterdir()) == [path.name]  # the temporary file was renamed into place
    assert cal.pass_costs(model, 8) is not None and calls == [8]  # from memory
    cal._memo.clear()
    assert cal.pass_costs(model, 4).tolist() == pytest.approx(first[:5].tolist()) and calls == [8]  # from disk
    assert cal.pass_costs(model, 16).size == 17 and calls == [8, 16]  # longer than what was measured: measure
    assert cal.pass_costs(model, 8, refresh=True)[-1] == 5.0 and calls == [8, 16, 8]  # the third measurement
    assert json.loads(path.read_text())["profile"][-1] == 5.0  # ... written over the file
    returned = cal.pass_costs(model, 8)
    returned[1] = 99.0  # the caller's copy: the memo is not touched
    assert cal.pass_costs(model, 8)[1] != 99.0


@pytest.mark.parametrize("content", ["not json", '{"version": V}', '{"version": V, "profile": [1, 2, 3]}',
                                     '{"version": OLD, "profile": [1, 2, 3, 4, 5, 6, 7, 8, 9]}',
                                     '{"version": V, "profile": [1, -2, 3, 4, 5, 6, 7, 8, 9]}'])
def test_an_unreadable_or_stale_cache_file_is_measured_again(tiny_factory, cache_dir, monkeypatch, content):
    model = tiny_factory("gpt2")
    cache_dir.mkdir(parents=True)
    content = content.replace("OLD", str(cal.PROFILE_VERSION - 1)).replace("V", str(cal.PROFILE_VERSION))
    (cache_dir / f"{cal.profile_key(model)}.json").write_text(content)
    monkeypatch.setattr(cal, "measure_pass_costs", lambda model, max_draft=32, **kw: np.ones(max_draft + 1))
    assert cal.pass_costs(model, 8).tolist() == [1.0] * 9


def test_a_good_cache_file_is_read_not_measured(tiny_factory, cache_dir, monkeypatch):
    model = tiny_factory("gpt2")
    cache_dir.mkdir(parents=True)
    (cache_dir / f"{cal.profile_key(model)}.json").write_text(
        json.dumps({"version": cal.PROFILE_VERSION, "profile": list(range(1, 10))}))
    monkeypatch.setattr(cal, "measure_pass_costs", lambda *a, **kw: pytest.fail("measured despite the cache"))
    assert cal.pass_costs(model, 8).tolist() == list(range(1, 10))


def test_an_unwritable_cache_only_costs_a_warning(tiny_factory, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(cal, "cache_dir", lambda: blocker)  # a file where the folder should be
    monkeypatch.setattr(cal, "measure_pass_costs", lambda model, max_draft=32, **kw: np.ones(max_draft + 1))
    assert cal.pass_costs(tiny_factory("llama"), 4).size == 5
    assert "could not cache the pass-cost profile" in caplog.text


def test_the_key_changes_with_what_changes_the_curve(tiny_factory):
    llama, gpt2 = tiny_factory("llama"), tiny_factory("gpt2")
    assert cal.profile_key(llama) == cal.profile_key(tiny_factory("llama", seed=3))  # weights do not matter
    assert cal.profile_key(llama) != cal.profile_key(gpt2)
    threads, before = torch.get_num_threads(), cal.profile_key(llama)
    try:
        torch.set_num_threads(threads + 1)
        assert cal.profile_key(llama) != before
    finally:
        torch.set_num_threads(threads)
    assert cal.profile_key(llama) != cal.profile_key(tiny_factory("llama").to(torch.float64))


def test_generate_calibrates_the_drafter_unless_told_not_to(tiny_factory, cache_dir):
    model = tiny_factory("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    for config, calibrated in ((DrafterConfig(), True), (DrafterConfig(calibrate=False), False),
                               (DrafterConfig(adaptive=False), False)):
        drafter = LookupDrafter(config)
        lookupdec.generate(model, prompt, max_new_tokens=4, drafter=drafter)
        assert (drafter.cost.profile is not None) == calibrated
    assert len(list(cache_dir.glob("*.json"))) == 1


def test_calibrate_hands_the_profile_to_a_drafter_for_the_transformers_route(tiny_factory, cache_dir):
    model = tiny_factory("gpt2")
    drafter = LookupDrafter(max_draft=8)
    profile = lookupdec.calibrate(drafter, model)
    assert profile.size == 9
    assert drafter.cost.costs(8).tolist() == pytest.approx(profile.tolist())


def test_a_failed_calibration_warns_and_keeps_the_straight_line(tiny_factory, cache_dir, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    short = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=30)).eval()
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    drafter = LookupDrafter()  # a draft of max_draft (64) does not fit in 30 positions: nothing to measure
    out = lookupdec.generate(short, prompt, max_new_tokens=4, drafter=drafter)
    assert torch.equal(out.sequences, short.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                     max_new_tokens=4, do_sample=False))
    assert drafter.cost.profile is None
    assert "could not measure the pass cost of GPT2LMHeadModel" in caplog.text
    with pytest.raises(ValueError, match="cannot hold a 64-token draft"):
        lookupdec.calibrate(drafter, short)


def test_generate_leaves_a_profile_set_by_hand_alone_and_follows_the_model(tiny_factory, cache_dir):
    llama, gpt2 = tiny_factory("llama"), tiny_factory("gpt2")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    drafter = LookupDrafter()
    drafter.cost.use_profile([1.0] * 33)
    lookupdec.generate(llama, prompt, max_new_tokens=3, drafter=drafter)
    assert drafter.cost.profile.tolist() == [1.0] * 33 and drafter.cost.profile_source is None
    drafter.cost.use_profile(None)
    lookupdec.generate(llama, prompt, max_new_tokens=3, drafter=drafter)
    assert drafter.cost.profile_source is llama
    lookupdec.generate(gpt2, prompt, max_new_tokens=3, drafter=drafter)  # a drafter moved to another model
    assert drafter.cost.profile_source is gpt2
    expected = cal.pass_costs(gpt2, drafter.drafter_config.max_draft)
    assert drafter.cost.profile.tolist() == pytest.approx(expected.tolist())


def test_measuring_one_model_does_not_hold_up_another(tiny_factory, cache_dir, monkeypatch):
    import threading

    known, slow = tiny_factory("llama"), tiny_factory("gpt2")
    cal.pass_costs(known, 8)  # in memory now
    started, release = threading.Event(), threading.Event()

    def blocking_measure(model, max_draft=32, **kw):
        started.set()
        assert release.wait(10)
        return np.ones(max_draft + 1)

    monkeypatch.setattr(cal, "measure_pass_costs", blocking_measure)
    worker = threading.Thread(target=cal.pass_costs, args=(slow, 8))
    worker.start()
    try:
        assert started.wait(10)
        answered = []
        other = threading.Thread(target=lambda: answered.append(cal.pass_costs(known, 8)))
        other.start()
        other.join(5)
        assert answered, "a model already measured waited for another model's measurement"
    finally:
        release.set()
        worker.join(10)


def test_calibrate_is_a_drafter_config_switch():
    with pytest.raises(ValueError, match="calibrate must be True or False"):
        DrafterConfig(calibrate="yes")


def test_calibration_happens_after_the_input_checks_and_outside_the_stats(tiny_factory, cache_dir, monkeypatch):
    import time

    measured = []

    def slow_measure(model, max_draft=32, **kw):
        measured.append(model)
        time.sleep(0.5)
        return np.ones(max_draft + 1)

    monkeypatch.setattr(cal, "measure_pass_costs", slow_measure)
    model = tiny_factory("llama")
    bad_mask = torch.tensor([[1, 0, 1], [1, 1, 1]])  # a hole in the middle: not left padding
    with pytest.raises(ValueError, match="left padding"):
        lookupdec.generate(model, torch.tensor([[5, 6, 7], [5, 6, 7]]), bad_mask, max_new_tokens=2)
    assert measured == []  # a refused call measures nothing
    started = time.perf_counter()
    out = lookupdec.generate(model, torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=3)
    elapsed = time.perf_counter() - started
    assert measured == [model]
    # The one-time measurement (0.5 s asleep) is not generation time, however long generation takes here.
    assert out.stats.total_seconds <= elapsed - 0.5


# --- a profile measured on a busy machine: checked before it is saved, refined by the passes that run ----------


def test_an_implausible_profile_is_measured_again_and_not_saved(tiny_factory, cache_dir, monkeypatch, caplog):
    spiky = np.array([1.0, 8.91, 1.19, 1.41, 1.15, 1.3, 1.4, 1.5, 1.6])  # one drafted token at 8.9 steps, two at 1.2
    calls = []

    def measure(model, max_draft, rows=1):
        calls.append(max_draft)
        return spiky.copy()

    monkeypatch.setattr(cal, "measure_pass_costs", measure)
    profile = cal.pass_costs(tiny_factory("llama"), 8)
    assert len(calls) == 1 + cal.REMEASURE
    assert profile.tolist() == spiky.tolist()  # still used by this process (the passes refine it)
    assert not list(cache_dir.glob("*.json"))
    assert "still looks disturbed" in caplog.text


def test_a_disturbed_measurement_is_repaired_by_measuring_again_then_saved(tiny_factory, cache_dir, monkeypatch):
    spiky = np.array([1.0, 8.91, 1.19, 1.41, 1.15, 1.3, 1.4, 1.5, 1.6])
    quiet = np.array([1.0, 1.5, 1.6, 1.41, 1.15, 1.3, 1.4, 1.5, 1.6])
    answers = [spiky, quiet]
    monkeypatch.setattr(cal, "measure_pass_costs", lambda model, max_draft, rows=1: answers.pop(0).copy())
    profile = cal.pass_costs(tiny_factory("llama"), 8)
    expected = np.minimum(spiky, quiet).tolist()  # each length's cheapest of the two
    assert profile.tolist() == expected and not answers
    saved = json.loads(next(cache_dir.glob("*.json")).read_text())["profile"]
    assert saved == expected


@pytest.mark.parametrize("profile, reason", [
    ([1.0, 8.91, 1.19, 1.41, 1.15], "1 drafted tokens priced at 8.91"),
    ([1.0, 0.5, 1.85, 1.43, 1.19], "priced at 0.50"),
    ([1.0, 1.02, 1.05, 1.54, 1.58], None),  # SmolLM2 on the benchmark machine, one thread
    ([1.0, 2.0, 1.5, 1.6, 1.7], None),  # jagged where a CPU's math library is
    ([1.0, 2.71, 3.02, 2.32, 4.25], None),  # dear everywhere (measured under load): only the passes can tell
])
def test_what_counts_as_implausible(profile, reason):
    found = cal.implausible(np.array(profile))
    assert (found is None) if reason is None else (reason in found)


def _true_profile(n: int = 33) -> np.ndarray:
    return np.array([1.0, 1.5, 2.0, 1.5, 1.6] + [1.6 + 0.05 * d for d in range(1, n - 4)])


def test_a_profile_priced_six_times_too_dear_heals_from_the_passes_observed():
    true = _true_profile()
    wrong = true.copy()
    wrong[1:] *= 6
    cost = lookupdec.drafter.PassCost()
    cost.use_profile(wrong, refine=True)
    assert cost.costs(8)[1] == pytest.approx(9.0)
    plain = 0.05
    for _ in range(3):
        cost.observe(0, plain)
    assert cost.costs(8).tolist() == pytest.approx(wrong[:9].tolist())  # no drafted pass seen yet: as measured
    cost.observe(32, plain * true[32])  # one long draft, at its true cost
    assert cost.costs(32).tolist() == pytest.approx(true.tolist())  # every length corrected by the same factor
    for _ in range(20):  # then two-token drafts, on a machine that got slower for them
        cost.observe(2, plain * true[2] * 1.5)
    healed = cost.costs(32)
    assert healed[2] == pytest.approx(true[2] * 1.5, rel=0.05)
    assert healed[32] == pytest.approx(true[32])  # a band keeps its own factor


def test_a_profile_set_by_hand_is_not_refined_and_a_new_profile_starts_afresh():
    cost = lookupdec.drafter.PassCost()
    cost.use_profile([1.0, 3.0, 3.0])  # by hand: the caller knows better
    cost.observe(0, 0.05)
    cost.observe(1, 0.05)
    assert cost.costs(2).tolist() == [1.0, 3.0, 3.0]
    cost.use_profile([1.0, 3.0, 3.0], refine=True)
    cost.observe(1, 0.05)
    assert cost.costs(2).tolist() == [1.0, 3.0, 3.0]  # the plain step of the old profile was forgotten
    cost.observe(0, 0.05)
    assert cost.costs(2).tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_the_passes_refine_a_calibrated_profile_for_every_drafter_of_the_model(cache_dir, peaky, monkeypatch):
    model, prompt = peaky
    true = _true_profile(9)
    dear = true.copy()
    dear[1:] *= 6  # measured on a busy machine, say
    monkeypatch.setattr(cal, "measure_pass_costs", lambda model, max_draft, rows=1: dear[: max_draft + 1].copy())
    drafted = []

    # Each pass takes what the true curve says, whatever this machine does.
    def observe(self, rows, width, _, sessions=()):
        drafted.append(width)
        self.batch_cost(rows).observe(width, 0.05 * true[min(width, true.size - 1)])

    monkeypatch.setattr(lookupdec.drafter.Drafter, "observe", observe)
    first = LookupDrafter(max_draft=8, use_cache=False)
    lookupdec.generate(model, prompt[:, :8], max_new_tokens=40, drafter=first)
    assert first.cost.profile.tolist() == pytest.approx(dear.tolist())  # the measurement itself is kept
    assert any(drafted)  # a probe ran a draft the dear profile would never have run
    healed = first.cost.costs(8)
    assert healed.tolist() == pytest.approx(true.tolist())
    second = LookupDrafter(max_draft=8, use_cache=False)  # a later call's drafter knows it too
    lookupdec.calibrate(second, model)
    assert second.cost.costs(8).tolist() == pytest.approx(true.tolist())


def test_seeded_sampling_prices_drafts_without_the_timings(cache_dir, peaky):
    # A seeded generator must give the same output whatever the passes taught the shared refinement meanwhile
    # (how many random draws a pass takes depends on its draft's length).
    model, prompt = peaky

    def sample():
        return lookupdec.generate(model, prompt[:, :8], max_new_tokens=40, do_sample=True,
                                  generator=torch.Generator().manual_seed(3)).sequences.tolist()

    first = sample()
    shared = cal.refinement(model)
    for width, seconds in ((0, 1.0), (1, 50.0), (2, 50.0), (3, 50.0), (8, 50.0), (16, 50.0), (32, 50.0)):
        for _ in range(5):
            shared.observe(width, seconds, 1.0)  # drafts now look 50x dearer than the profile says
    drafter = LookupDrafter()
    lookupdec.calibrate(drafter, model)
    assert drafter.cost.costs(8)[1] > 2 * drafter.cost.costs(8, refined=False)[1]  # the refinement did take
    assert sample() == first
