"""Batched generation: every row gives what single-sequence ``model.generate`` gives on that row alone.

Rows of different lengths (left padding), drafts of different lengths, rows that accept different numbers of tokens
and finish at different times (EOS inside drafts, budgets), the cache compaction, sampling per row, and bad input.
"""

from collections import Counter

import pytest
import torch
from test_exactness import _plain, _prompts
from test_sampling import ALPHA, STEPS, _pad, _plain_samples, _two_sample_p, peaky_model

import lookupdec
from lookupdec import LookupDrafter
from lookupdec import batch as batch_module
from lookupdec.drafter import NoDrafts


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
    out = lookupdec.generate(tiny_model, ids, attention_mask=mask, max_new_tokens=budget, drafter=LookupDrafter())
    assert out.sequences[:, : ids.shape[1]].tolist() == ids.tolist()
    assert _rows(out, ids.shape[1], pad) == _singles(tiny_model, prompts, budget)
    assert [r.new_tokens for r in out.stats.rows] == [len(r) for r in _singles(tiny_model, prompts, budget)]
    assert out.stats.new_tokens == sum(r.new_tokens for r in out.stats.rows)
    if budget == 50:
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


def test_one_row_batch_equals_the_single_path(tiny_model):
    prompt = _prompts(tiny_model, count=1, seed=3)[0]
    two = lookupdec.generate(tiny_model, prompt.repeat(2, 1), max_new_tokens=30)
    one = lookupdec.generate(tiny_model, prompt, max_new_tokens=30)
    assert two.sequences.tolist() == one.sequences.repeat(2, 1).tolist()
    assert len(two.stats.rows) == 2 and one.stats.rows == []


def test_batched_sampling_follows_each_rows_distribution():
    # Two different prompts, three copies each per call: each row's samples must be distributed like plain
    # sampling of that prompt alone, with independent randomness per row.
    model, prompt = peaky_model()
    other = prompt[:, 3:]  # a shorter prompt: the batch gets left padding
    ids, mask = _left_pad([prompt, other, prompt, other, prompt, other], 2)
    gen = torch.Generator().manual_seed(7)
    rows = {0: [], 1: []}
    for _ in range(250):
        out = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=True,
                                 generator=gen, drafter=LookupDrafter(adaptive=False, use_cache=False))
        for i, row in enumerate(out.sequences[:, ids.shape[1]:].tolist()):
            rows[i % 2].append(row[:STEPS])
    for which, p in ((0, prompt), (1, other)):
        plain = _plain_samples(model, p, 1500)
        ours = _pad([[t for t in row] for row in rows[which]])
        p_values = [_two_sample_p(Counter(plain[:, pos].tolist()), Counter(ours[:, pos].tolist()))
                    for pos in range(STEPS)]
        assert min(p_values) > ALPHA, (which, p_values)
    # Rows with the same prompt in one call drew different samples somewhere: randomness is per row.
    assert len({tuple(r) for r in rows[0]}) > 10


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


def test_keyed_sampling_gives_a_seed_the_same_output_alone_batched_and_undrafted():
    # The server's sampling: the token at output position t is drawn at a uniform fixed by (seed, t), so what was
    # drafted and who shared the pass change nothing. Compared with the same rows decoded plainly (no drafts).
    from lookupdec.verify import verify_keyed

    model, prompt = peaky_model()
    prompts = [prompt, prompt[:, 3:], prompt[:, 7:]]

    def keyed(seed):
        return lambda logits, draft, process, position: verify_keyed(logits, draft, process, seed, position)

    def run(batched, drafting):
        drafter = LookupDrafter()
        outputs = []
        with torch.inference_mode():
            runs = [batch_module.BatchRun(model, drafter)] * (3 if batched else 1)
            rows = []
            for i, prompt in enumerate(prompts):
                row = _row(model, drafter, prompt, 40, pick=keyed(100 + i), do_sample=True, temperature=1.0)
                if not drafting:
                    row.session = NoDrafts()
                rows.append(row)
            if batched:
                for row in rows:
                    runs[0].join(row)
                while runs[0].rows:
                    runs[0].step()
            else:
                for row in rows:
                    single = batch_module.BatchRun(model, drafter)
                    single.join(row)
                    while single.rows:
                        single.step()
            outputs = [row.tokens.tolist() for row in rows]
            accepted = sum(row.stats.accepted_tokens for row in rows)
        return outputs, accepted

    plain, _ = run(batched=False, drafting=False)
    alone, accepted_alone = run(batched=False, drafting=True)
    together, accepted_together = run(batched=True, drafting=True)
    assert alone == plain and together == plain
    assert accepted_alone > 0 and accepted_together > 0  # drafts were verified and kept: the keys did the work
    assert len({tuple(o) for o in plain}) == 3
