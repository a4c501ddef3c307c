"""Batched generation: every row gives what single-sequence ``model.generate`` gives on that row alone.

Rows of different lengths (left padding), drafts of different lengths, rows that accept different numbers of tokens
and finish at different times (EOS inside drafts, budgets), the cache compaction, sampling per row, and bad input.
"""

import numpy as np
import pytest
import torch
from helpers_sampling import ALPHA, STEPS, per_position_p
from test_exactness import _plain, _prompts

import lookupdec
from lookupdec import LookupDrafter
from lookupdec import batch as batch_module
from lookupdec.drafter import NoDrafts
from lookupdec.serve import scheduler
from lookupdec.serve.scheduler import PrefillScheduler


@pytest.fixture(autouse=True)
def _chunk_small_prompts(monkeypatch):
    """The tests' "long" prompts are a few hundred tokens (the tiny models' context); a real server prefills such
    prompts whole (``WHOLE_PROMPT``), so the chunking is exercised on them by lowering that bound."""
    monkeypatch.setattr(scheduler, "WHOLE_PROMPT", 32)


def _left_pad(prompts, pad):
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:] = p[0]
        mask[i, width - p.shape[1]:] = 1
    return ids, mask


def _rows(out, width, pad):
    """New tokens of each row, the trailing padding of rows that finished early dropped."""
    rows = []
    for row in out.sequences[:, width:].tolist():
        while row and row[-1] == pad:
            row.pop()
        rows.append(row)
    return rows


def _singles(model, prompts, budget, **kw):
    return [_plain(model, p, max_new_tokens=budget, **kw)[0, p.shape[1]:].tolist() for p in prompts]


@pytest.mark.parametrize("budget", [1, 3, 50])
def test_rows_match_single_sequence_greedy(tiny_model, budget):
    prompts = _prompts(tiny_model, count=4, seed=5)  # lengths 58, 61, 64, 67: left padding differs per row
    pad = tiny_model.generation_config.pad_token_id
    ids, mask = _left_pad(prompts, pad)
    # Not calibrated: timed pass costs could price every draft out on a busy machine, and budget 50 needs drafts.
    drafter = LookupDrafter(calibrate=False)
    out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=budget, drafter=drafter)
    assert out.sequences[:, : ids.shape[1]].tolist() == ids.tolist()
    assert _rows(out, ids.shape[1], pad) == _singles(tiny_model, prompts, budget)
    assert [r.new_tokens for r in out.stats.rows] == [len(r) for r in _singles(tiny_model, prompts, budget)]
    assert out.stats.new_tokens == sum(r.new_tokens for r in out.stats.rows)
    if budget == 50:
        assert out.stats.drafted_tokens > 0
    if budget == 50 and tiny_model.config.model_type != "gpt2":  # the random gpt2 seldom copies its prompt
        assert out.stats.accepted_tokens > 0  # drafts were accepted, on rows that accept different amounts
        assert min(r.target_passes for r in out.stats.rows) < budget


def test_matches_plain_batched_generate(tiny_model):
    prompts = _prompts(tiny_model, count=3, seed=7)
    ids, mask = _left_pad(prompts, tiny_model.generation_config.pad_token_id)
    plain = tiny_model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=40)
    assert out.sequences.tolist() == plain.tolist()


def test_rows_finish_at_different_times(tiny_factory):
    # EOS is a token one row produces early: that row stops there (padded after), the others go on.
    model = tiny_factory("llama")
    prompts = _prompts(model, count=3, seed=11)
    singles = _singles(model, prompts, 40)
    eos = singles[0][5]
    config = model.generation_config
    old = config.eos_token_id
    config.eos_token_id = eos
    try:
        ids, mask = _left_pad(prompts, config.pad_token_id)
        expected = _singles(model, prompts, 40)
        out = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=40)
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    finally:
        config.eos_token_id = old
    assert _rows(out, ids.shape[1], config.pad_token_id) == expected
    assert out.sequences.tolist() == plain.tolist()
    lengths = [len(row) for row in expected]
    assert min(lengths) < max(lengths)
    passes = [r.target_passes for r in out.stats.rows]
    assert passes[lengths.index(min(lengths))] < max(passes)  # the finished row left the batch


def test_compaction_keeps_rows_exact(tiny_model, monkeypatch):
    # Compact after every step (no slack): holes are squeezed out all the time, and outputs stay exact.
    monkeypatch.setattr(batch_module, "_COMPACT_SLACK", -10**6)
    slots = []

    def hook(module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        slots.append(cache.get_seq_length())

    prompts = _prompts(tiny_model, count=3, seed=13)
    pad = tiny_model.generation_config.pad_token_id
    ids, mask = _left_pad(prompts, pad)
    handle = tiny_model.register_forward_hook(hook, with_kwargs=True)
    try:
        out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=50,
                                 drafter=LookupDrafter(adaptive=False))
    finally:
        handle.remove()
    assert _rows(out, ids.shape[1], pad) == _singles(tiny_model, prompts, 50)
    # Compacted, the cache is as long as the longest row: its prompt and new tokens, nothing else.
    assert max(slots) <= max(p.shape[1] for p in prompts) + 50 + 32


def test_holes_are_squeezed_out_once_they_pass_a_quarter_of_the_longest_row(tiny_model):
    # Every pass reads the cache's masked holes too, so they are not left to double it: 200 slots hold rows of 144
    # and 100 tokens (holes beyond 144 + 144 // 4 + 16 = 196: compacted), or of 150 (within 203: left alone).
    from lookupdec._transformers import batch_cache, forward_params, target_forward

    gen = torch.Generator().manual_seed(5)
    for longest, compacted in ((144, True), (150, False)):
        mask = torch.zeros((2, 200), dtype=torch.bool)
        for row, tokens in enumerate((longest, 100)):
            mask[row, torch.randperm(200, generator=gen)[:tokens].sort().values] = True
        ids = torch.randint(3, tiny_model.config.vocab_size, (2, 200), generator=gen)
        cache = batch_cache(tiny_model)
        with torch.inference_mode():
            target_forward(tiny_model, ids, cache, 1, forward_params(tiny_model), mask,
                           (mask.long().cumsum(-1) - 1).clamp(min=0))
            kept = batch_module._compact(cache, mask, longest)
        assert kept.shape[1] == (longest if compacted else 200)
        assert cache.get_seq_length() == kept.shape[1]
        assert kept.sum(1).tolist() == [longest, 100]  # every row's tokens kept


def test_two_identical_rows_equal_one_row_alone(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=3)[0]
    two = lookupdec.generate(tiny_model, prompt.repeat(2, 1), max_new_tokens=30)
    one = lookupdec.generate(tiny_model, prompt, max_new_tokens=30)
    assert two.sequences.tolist() == one.sequences.repeat(2, 1).tolist()
    assert len(two.stats.rows) == 2 and len(one.stats.rows) == 1
    assert [row.new_tokens for row in two.stats.rows] == [one.stats.new_tokens] * 2


def test_batched_sampling_follows_each_rows_distribution(peaky, plain_reference):
    # Two different prompts, COPIES rows of each per call: each row's samples must be distributed like plain
    # sampling of that prompt alone, and the rows of one call must draw independently of each other.
    model, prompt = peaky
    other = prompt[:, 3:]  # a shorter prompt: the batch gets left padding
    ids, mask = _left_pad([prompt, other] * COPIES, 2)
    gen = torch.Generator().manual_seed(7)
    calls = {0: [], 1: []}  # per prompt: per call, its COPIES samples [COPIES, STEPS]
    for _ in range(CALLS):
        out = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=True,
                                 generator=gen, drafter=LookupDrafter(adaptive=False, use_cache=False))
        new = out.sequences[:, ids.shape[1]:].cpu()  # [2 * COPIES, <= STEPS]: rows that ended at EOS padded
        new = torch.nn.functional.pad(new, (0, STEPS - new.shape[1]), value=2)  # as plain pads them
        for which in (0, 1):
            calls[which].append(new[which::2])
    for which, p in ((0, prompt), (1, other)):
        ours = torch.cat(calls[which])
        p_values = per_position_p(plain_reference(p), ours)
        assert min(p_values) > ALPHA, (which, p_values)
        # Independence: two copies in one call are equal no more often than two samples from different calls
        # (rows that shared their randomness would be equal in nearly every call).
        within = np.mean([_equal_pairs(rows, rows) for rows in calls[which]])
        across = np.mean([_equal_pairs(a, b) for a, b in zip(calls[which], calls[which][1:])])
        assert within < across + 0.1, (which, within, across)


COPIES, CALLS = 10, 60  # 600 samples per prompt, against plain's 6000 (helpers_sampling)


def _equal_pairs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of pairs (row of a, another row of b) that are the same sample; a, b [COPIES, STEPS]."""
    same = (a[:, None, :] == b[None, :, :]).all(-1)  # [COPIES, COPIES]
    off = ~torch.eye(len(a), dtype=torch.bool)
    return float(same[off].float().mean())


def test_bad_batches_are_refused(tiny_model):
    prompts = _prompts(tiny_model, count=2, seed=17)
    ids, mask = _left_pad(prompts, 2)
    with pytest.raises(ValueError, match="left padding"):
        lookupdec.generate(tiny_model, ids, attention_mask=mask.flip(1), max_new_tokens=4)
    with pytest.raises(ValueError, match="at least one token"):
        lookupdec.generate(tiny_model, ids, attention_mask=torch.zeros_like(mask), max_new_tokens=4)
    with pytest.raises(ValueError, match="streamer"):
        lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=4, streamer=object())
    with pytest.raises(ValueError, match="trace"):
        lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=4, trace=[None])

    class DuckDrafter:  # not a lookupdec Drafter: the loops drive drafters through Drafter.propose
        def start(self, prompt, eos_ids=()):
            raise AssertionError("not reached")

    for rows in (ids, ids[:1]):  # a batch, and one row
        with pytest.raises(TypeError, match="drafter must be a LookupDrafter"):
            lookupdec.generate(tiny_model, rows, attention_mask=mask[: len(rows)], max_new_tokens=4,
                               drafter=DuckDrafter())


def test_sliding_window_models_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(3, 64, (2, 10))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        lookupdec.generate(model, ids, max_new_tokens=4)


def test_traces_per_row(tiny_model):
    class Recorder:
        def __init__(self):
            self.prompt, self.kept = None, 0

        def start(self, prompt):
            self.prompt = prompt

        def step(self, draft, accepted, token, kept, seconds):
            assert 0 <= accepted <= len(draft) and kept <= accepted + 1
            self.kept += kept

    prompts = _prompts(tiny_model, count=2, seed=19)
    ids, mask = _left_pad(prompts, 2)
    recorders = [Recorder(), Recorder()]
    out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=20, trace=recorders)
    for recorder, prompt, row in zip(recorders, prompts, out.stats.rows):
        assert recorder.prompt == prompt[0].tolist()
        assert recorder.kept == row.new_tokens


@pytest.mark.slow
def test_real_model_batch_of_edits(smollm2):
    model, tokenizer = smollm2
    texts = [
        "Rewrite this YAML with the port changed to 9090:\n\nserver:\n  host: 0.0.0.0\n  port: 8080\n  workers: 4\n",
        "Copy this list, in the same order:\n\n- alpha\n- beta\n- gamma\n- delta\n- epsilon\n",
        "Say hello.",
    ]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for t in texts]
    pad = tokenizer.pad_token_id
    ids, mask = _left_pad(prompts, pad)
    out = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=48)
    expected = _singles(model, prompts, 48)
    got = out.sequences[:, ids.shape[1]:].tolist()
    for row, want in zip(got, expected):
        assert row[: len(want)] == want
        assert all(t == pad for t in row[len(want):])
    assert out.stats.accepted_tokens > 0


def _row(model, drafter, prompt, budget, pick=None, **kw):
    from lookupdec._transformers import resolve_generation
    from lookupdec.verify import verify_greedy

    resolved = resolve_generation(model, prompt, max_new_tokens=budget, generation_config=None, logits_processor=None,
                                  stopping_criteria=None, **kw)
    pick = pick or (lambda logits, draft, process, position: verify_greedy(logits, draft, process))
    session = drafter.start(prompt[0].numpy(), eos_ids=resolved.eos_ids)
    return batch_module.Row(prompt, resolved, session, budget, pick)


def test_rows_joining_a_running_batch_match_single_sequence_greedy(tiny_model):
    # Requests arrive while others run: each is prefilled alone and appended to the batch's cache (the shorter
    # side left-padded), at different steps, and each row still gives what it gives alone; rows leave as they end.
    prompts = _prompts(tiny_model, count=5, seed=11)
    budgets = [40, 7, 30, 1, 25]
    drafter = LookupDrafter()
    run = batch_module.BatchRun(tiny_model, drafter)
    rows, finished, step = [], [], 0
    arrivals = {0: [0, 1], 2: [2], 3: [3], 9: [4]}  # step -> prompts joining before it
    with torch.inference_mode():
        while step == 0 or run.rows or step <= max(arrivals):
            for i in arrivals.get(step, []):
                rows.append(_row(tiny_model, drafter, prompts[i], budgets[i]))
                run.join(rows[-1])
            if run.rows:
                finished += run.step()
            step += 1
    assert sorted(map(id, finished)) == sorted(map(id, rows))
    expected = [_singles(tiny_model, [p], b)[0] for p, b in zip(prompts, budgets)]
    assert [row.tokens.tolist() for row in rows] == expected
    assert [row.finish_reason for row in rows] == ["length" if len(e) == b else "stop"
                                                   for e, b in zip(expected, budgets)]
    assert sum(row.stats.accepted_tokens for row in rows) > 0


def test_a_cancelled_row_leaves_and_the_others_are_unchanged(tiny_model):
    prompts = _prompts(tiny_model, count=3, seed=13)
    drafter = LookupDrafter()
    run = batch_module.BatchRun(tiny_model, drafter)
    committed = []
    with torch.inference_mode():
        rows = [_row(tiny_model, drafter, p, 30) for p in prompts]
        rows[1].on_commit = lambda tokens, done: committed.append((list(tokens), done))
        for row in rows:
            run.join(row)
        run.step()
        run.step()
        rows[1].cancelled = True
        assert rows[1] in run.step() and rows[1].finish_reason == "cancelled"
        while run.rows:
            run.step()
    assert committed[-1] == ([], True) and all(not done for _, done in committed[:-1])
    assert sum(len(t) for t, _ in committed) == len(rows[1].tokens)
    for i in (0, 2):
        assert rows[i].tokens.tolist() == _singles(tiny_model, [prompts[i]], 30)[0]


def test_keyed_sampling_gives_a_seed_the_same_output_alone_batched_and_undrafted(peaky):
    # The server's sampling: the token at output position t is drawn at a uniform fixed by (seed, t), so what was
    # drafted and who shared the pass change nothing. Compared with the same rows decoded plainly (no drafts).
    from lookupdec.verify import verify_keyed

    model, prompt = peaky
    prompts = [prompt, prompt[:, 3:], prompt[:, 7:]]

    def keyed(seed):
        return lambda logits, draft, process, position: verify_keyed(logits, draft, process, seed, position)

    def run(batched, drafting):
        """Each row's new tokens (row i sampled with seed 100 + i), and the drafted tokens kept in all rows."""
        drafter = LookupDrafter()
        with torch.inference_mode():
            rows = []
            for i, p in enumerate(prompts):
                row = _row(model, drafter, p, 40, pick=keyed(100 + i), do_sample=True, temperature=1.0)
                if not drafting:
                    row.session = NoDrafts()
                rows.append(row)
            for together in ([rows] if batched else [[row] for row in rows]):
                run = batch_module.BatchRun(model, drafter)
                for row in together:
                    run.join(row)
                while run.rows:
                    run.step()
        return [row.tokens.tolist() for row in rows], sum(row.stats.accepted_tokens for row in rows)

    plain, _ = run(batched=False, drafting=False)
    alone, accepted_alone = run(batched=False, drafting=True)
    together, accepted_together = run(batched=True, drafting=True)
    assert alone == plain and together == plain
    assert accepted_alone > 0 and accepted_together > 0  # drafts were verified and kept: the keys did the work
    assert len({tuple(o) for o in plain}) == 3


# ---------------------------------------------------------------------------------------------------------------
# The server's joins: failures that stay in their row, cancels, sliding-window models (the server's scheduler of
# joins, prefill in chunks, is tested in test_serve_scheduler.py)


def _long_prompt(model, seed=0, head=100, cont=80):
    """About 280 tokens: a random head, the model's greedy continuation of it, the head again (so drafts copy)."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(3, model.config.vocab_size, (1, head), generator=gen)
    out = model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=cont, do_sample=False)
    prompt = torch.cat([first, out[:, head:], first], dim=1)
    prompt[prompt == model.generation_config.pad_token_id] = 3
    return prompt


def _state(run):
    return (run.kv_mask.clone(), run.counts.copy(), list(run.rows), run._unmasked,
            [(layer.keys.clone(), layer.values.clone()) for layer in run.cache.layers])


def _same_state(a, b):
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and a[2] == b[2] and a[3] == b[3]
    assert len(a[4]) == len(b[4])
    for (k0, v0), (k1, v1) in zip(a[4], b[4]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_join_that_fails_half_way_leaves_the_batch_as_it_was(tiny_model, monkeypatch):
    prompts = _prompts(tiny_model, count=4, seed=23)
    drafter = LookupDrafter()
    run = batch_module.BatchRun(tiny_model, drafter)
    real = batch_module.append_cache_rows

    def faulty(cache, other):  # the last layer cannot be appended: the failure comes after the first layers
        other.layers[-1].keys = None
        real(cache, other)

    rows = [_row(tiny_model, drafter, p, 40) for p in prompts]
    with torch.inference_mode():
        run.join(rows[0])
        run.join(rows[1])
        for _ in range(3):
            run.step()
        before = _state(run)
        monkeypatch.setattr(batch_module, "append_cache_rows", faulty)
        with pytest.raises(AttributeError):
            run.join(rows[2])
        _same_state(_state(run), before)
        assert rows[2].prefill_cache is None and rows[2].prefilled == 0
        joins = PrefillScheduler(run)
        joins.enqueue(rows[3])  # the server's way: the row ends with its error, the batch is as it was
        monkeypatch.setattr(PrefillScheduler, "busy_budget", lambda self: 24)  # a chunk a round, no credit needed
        ended = []
        while joins.joining:  # (no step meanwhile, to compare the state)
            ended += joins.prefill_pending()
        assert ended == [rows[3]]
        assert isinstance(rows[3].error, AttributeError) and rows[3].finish_reason == "error"
        _same_state(_state(run), before)
        monkeypatch.setattr(batch_module, "append_cache_rows", real)
        while run.rows:
            run.step()
    for i in (0, 1):
        assert rows[i].tokens.tolist() == _singles(tiny_model, [prompts[i]], 40)[0]


class _Fault(Exception):
    pass


def _raising_from(call: int, method):
    """``method`` that raises :class:`_Fault` from its ``call``-th call on."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= call:
            raise _Fault(f"injected at call {calls[0]}")
        return method(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("fault", ["processor", "pick", "offer", "commit", "on_commit", "finish", "prefill"])
def test_a_rows_failure_ends_that_row_only(tiny_factory, fault):
    from transformers import LogitsProcessor, LogitsProcessorList

    from lookupdec._transformers import resolve_generation
    from lookupdec.verify import verify_greedy

    model = tiny_factory("llama")
    prompts = _prompts(model, count=3, seed=29)
    drafter = LookupDrafter()
    run = batch_module.BatchRun(model, drafter)
    joins = PrefillScheduler(run)
    rows = [_row(model, drafter, p, 40) for p in prompts]
    bad = rows[1]
    if fault == "processor":
        class Faulty(LogitsProcessor):  # changes nothing, then raises from its third call on
            calls = 0

            def __call__(self, input_ids, scores):
                self.calls += 1
                if self.calls >= 3:
                    raise _Fault("injected")
                return scores

        resolved = resolve_generation(model, prompts[1], max_new_tokens=40, generation_config=None,
                                      logits_processor=LogitsProcessorList([Faulty()]), stopping_criteria=None)
        bad = rows[1] = batch_module.Row(prompts[1], resolved, drafter.start(prompts[1][0].numpy()), 40,
                                         lambda logits, draft, process, position: verify_greedy(logits, draft,
                                                                                               process))
    elif fault == "pick":
        bad.pick, bad.plain_greedy = _raising_from(3, bad.pick), False
    elif fault in ("offer", "commit", "finish"):
        setattr(bad.session, fault, _raising_from(3 if fault != "finish" else 1, getattr(bad.session, fault)))
    elif fault == "on_commit":
        bad.on_commit = _raising_from(3, lambda tokens, done: None)
    ended = []
    with torch.inference_mode():
        for row in rows:
            if fault == "prefill" and row is bad:
                # The prefill's pass fails (as a token past the vocabulary would on a CPU; on CUDA that is a
                # device-side assert, which no process survives, so the fault is raised instead).
                prefill = run.prefill_pass

                def failing(row, n, prefill=prefill):
                    if row is bad:
                        raise _Fault("the prefill's pass fails")
                    return prefill(row, n)

                run.prefill_pass = failing
                joins.enqueue(row)
            else:
                run.join(row)
        while run.rows or joins.joining:  # the server's turns: a round of prefill, then a step
            ended += joins.prefill_pending()
            if run.rows:
                ended += joins.step()
            assert all(row.error is None for row in run.rows)
    assert sorted(map(id, ended)) == sorted(map(id, rows))
    assert bad.finish_reason == "error" and isinstance(bad.error, _Fault)
    for i in (0, 2):
        assert rows[i].error is None
        assert rows[i].tokens.tolist() == _singles(model, [prompts[i]], 40)[0]


def test_a_failed_row_fails_generate(tiny_model, monkeypatch):
    # lookupdec.generate's batches: one row's failure is the call's, as in a single-row generation.
    prompts = _prompts(tiny_model, count=2, seed=31)
    ids, mask = _left_pad(prompts, 2)
    from lookupdec import drafter as drafter_module

    monkeypatch.setattr(drafter_module.DraftSession, "commit", _raising_from(3, drafter_module.DraftSession.commit))
    with pytest.raises(_Fault):
        lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=20)


class _Recording:
    """A session that drafts ``answer`` (tokens past EOS included, which no real session drafts) and records what
    the loop tells it."""

    prediction_accepted = prediction_rejected = 0

    def __init__(self, answer):
        from lookupdec.policy import Offer

        self.Offer, self.answer, self.done = Offer, answer, 0
        self.offered = batch_module.EMPTY
        self.commits, self.finished = [], []

    def offer(self, limit):
        self.offered = np.asarray(self.answer[self.done: self.done + max(limit, 0)], dtype=np.int32)
        return self.Offer(self.offered, 1.0, 1.0)

    def take(self, length):
        return self.offered[:length]

    def commit(self, tokens, seconds=None):
        self.commits.append([int(t) for t in tokens])
        self.done += len(tokens)

    def finish(self, *generated):
        self.finished.append(generated)



def test_a_session_never_sees_tokens_after_eos(tiny_factory):
    # The draft runs past an EOS and is accepted whole: the pass yields tokens after the EOS, which end the row
    # there; the session is handed the tokens up to the EOS only.
    model = tiny_factory("llama")
    prompt = _prompts(model, count=1, seed=13)[0]
    answer = _singles(model, [prompt], 30)[0]
    config = model.generation_config
    old = config.eos_token_id
    stop = next(i for i in range(8, len(answer)) if answer[i] not in answer[:i])  # its first occurrence
    config.eos_token_id = answer[stop]
    try:
        expected = _singles(model, [prompt], 30)[0]
        drafter = LookupDrafter(adaptive=False)
        run = batch_module.BatchRun(model, drafter)
        row = _row(model, drafter, prompt, 30)
    finally:
        config.eos_token_id = old
    row.session = _Recording(answer)
    with torch.inference_mode():
        run.join(row)
        while run.rows:
            run.step()
    assert row.tokens.tolist() == expected == answer[: stop + 1]
    assert sum(row.session.commits, []) == expected
    assert len(row.session.commits) < len(expected)  # drafts were accepted: the EOS came inside a pass
    assert row.session.finished == [()]  # done by itself: everything it committed joins the rolling cache


def test_cancel_used_limits_what_joins_the_rolling_cache(tiny_model):
    prompts = _prompts(tiny_model, count=2, seed=41)
    drafter = LookupDrafter()
    run = batch_module.BatchRun(tiny_model, drafter)
    rows = [_row(tiny_model, drafter, p, 40) for p in prompts]
    finished = []
    for row in rows:
        real = row.session.finish
        row.session.finish = lambda *args, real=real: (finished.append(args), real(*args))
    with torch.inference_mode():
        for row in rows:
            run.join(row)
        for _ in range(4):
            run.step()
        generated = rows[0].generated
        assert generated > 3
        rows[0].cancel(used=3)
        rows[0].cancel()  # a later cancel without a count (the web layer's cleanup) does not widen it
        rows[0].cancel(used=5)
        assert rows[0] in run.step()
        while run.rows:
            run.step()
    assert rows[0].finish_reason == "cancelled" and rows[0].used == 3 and rows[0].generated == generated
    assert finished == [(3,), ()]
    assert rows[1].tokens.tolist() == _singles(tiny_model, [prompts[1]], 40)[0]


def _sliding_model():
    """A tiny random-weight Mistral with a 16-token sliding window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, bos_token_id=0,
                           eos_token_id=1, pad_token_id=2)
    model = MistralForCausalLM(config).eval()
    model.generation_config.pad_token_id = 2
    return model


def test_a_sliding_window_model_runs_one_row_at_a_time_exactly():
    model = _sliding_model()
    prompts = _prompts(model, count=2, seed=43)  # longer than the window
    drafter = LookupDrafter()
    run = batch_module.BatchRun(model, drafter)
    assert run.one_at_a_time
    rows = [_row(model, drafter, p, 40) for p in prompts]
    with torch.inference_mode():
        for row in rows:
            run.join(row)
            with pytest.raises(RuntimeError, match="one row at a time"):
                run.join(_row(model, drafter, prompts[0], 4))
            ended = []
            while run.rows:
                ended += run.step()
            assert ended == [row]
    for row, prompt in zip(rows, prompts):
        assert row.tokens.tolist() == _singles(model, [prompt], 40)[0]
    assert sum(row.stats.accepted_tokens for row in rows) > 0
