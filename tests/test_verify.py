"""The acceptance rule's fast paths against its slow twin (``lookupdec._reference``): the lazy path (CPU logits,
one position at a time) and the eager one (accelerator logits: every position at once, one transfer), with and
without logits processors, and with a generator on another device than the logits."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookupdec import _reference, verify
from lookupdec.verify import verify_greedy, verify_sample


def _case(seed: int, d: int, vocab: int, ties: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(d + 1, vocab, generator=gen)
    if ties:  # two equal maxima in every row: argmax must pick the first, on every path
        logits = torch.round(logits)
        logits[:, 1] = logits.max(dim=-1).values
        logits[:, vocab - 1] = logits[:, 1]
    argmax = logits.argmax(-1)
    # Drafts right for a while, then wrong, so every verdict position occurs.
    keep = int(torch.randint(0, d + 1, (), generator=gen))
    draft = [int(argmax[pos]) if pos < keep else int((argmax[pos] + 1) % vocab) for pos in range(d)]
    return logits, np.array(draft, dtype=np.int64)


def _double_odd_tokens(pos, row):  # a processor whose effect depends on the position, like a penalty would
    return row + (pos % 2) * (torch.arange(row.numel()) % 2).to(row.dtype)


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 10**6), d=st.integers(0, 6), vocab=st.integers(2, 12), ties=st.booleans(),
       eager=st.booleans(), processed=st.booleans())
def test_greedy_paths_match_the_reference(seed, d, vocab, ties, eager, processed):
    logits, draft = _case(seed, d, vocab, ties)
    process = _double_odd_tokens if processed else None
    rows = logits if process is None else torch.stack([process(pos, logits[pos]) for pos in range(d + 1)])
    expected = _reference.accept_greedy(rows.tolist(), draft.tolist())
    verdict = verify_greedy(logits, draft, process, eager=eager)
    assert (verdict.accepted, verdict.token) == expected


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 10**6), d=st.integers(0, 6), vocab=st.integers(2, 12))
def test_lazy_sampling_draws_the_same_samples_as_the_reference(seed, d, vocab):
    # Same seed, same samples: the CPU path reads the generator exactly as the rule is written.
    logits, draft = _case(seed, d, vocab, ties=False)
    logits = logits * 2.0
    ours = verify_sample(logits, draft, None, torch.Generator().manual_seed(seed), eager=False)
    theirs = _reference.accept_sample(logits, draft.tolist(), torch.Generator().manual_seed(seed))
    assert (ours.accepted, ours.token) == theirs


def _committed_counts(rule, logits, draft, runs=12000):
    gen = torch.Generator().manual_seed(0)
    counts = [dict() for _ in range(len(draft) + 1)]
    for _ in range(runs):
        v = rule(logits, draft, None, gen)
        for pos, token in enumerate(draft[: v.accepted].tolist() + [v.token]):
            counts[pos][token] = counts[pos].get(token, 0) + 1
    return counts


def _fit_p(counts: dict, p: torch.Tensor) -> float:
    from scipy import stats

    observed = np.array([counts.get(k, 0) for k in range(len(p))], dtype=float)
    expected = p.double().numpy() * observed.sum()
    assert observed[expected == 0].sum() == 0, "sampled a token of probability zero"
    keep = expected > 0
    expected[keep] *= observed.sum() / expected[keep].sum()
    return float(stats.chisquare(observed[keep], expected[keep])[1])


@pytest.mark.parametrize("cross_device", [False, True])
def test_eager_sampling_commits_tokens_distributed_as_p(cross_device, monkeypatch):
    # The first committed token follows p_0 whatever the draft; given the first drafted token was kept, the next
    # follows p_1 (rows here do not depend on the prefix). cross_device: the generator stands for one on another
    # device than the logits (uniforms moved over, categorical draws by inverting the cumulative distribution).
    if cross_device:
        monkeypatch.setattr(verify, "_same_device", lambda generator, device: False)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    p = torch.softmax(logits, -1)
    draft = np.array([int(p[0].argmax()), int(p[1].argmax())])
    counts = _committed_counts(lambda *a: verify_sample(*a, eager=True), logits, draft)
    first = counts[0]
    second = counts[1]
    assert min(_fit_p(first, p[0]), _fit_p(second, p[1])) > 1e-3


def test_eager_sampling_catches_a_wrong_rule(monkeypatch):
    # The same check fails for a rule that accepts with probability 1 (the distribution test above can fail).
    monkeypatch.setattr(verify, "_uniform", lambda shape, generator, device: torch.zeros(shape, device=device))
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    p = torch.softmax(logits, -1)
    draft = np.array([int(p[0].argmax()), int(p[1].argmax())])
    counts = _committed_counts(lambda *a: verify_sample(*a, eager=True), logits, draft, runs=3000)
    assert _fit_p(counts[0], p[0]) < 1e-12


def test_cross_device_draws_never_pick_a_token_of_zero_probability(monkeypatch):
    monkeypatch.setattr(verify, "_same_device", lambda generator, device: False)
    p = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    gen = torch.Generator().manual_seed(0)
    assert {int(verify._draw(p, gen)) for _ in range(500)} == {1, 3}
