"""Sampling exactness: committed tokens follow the target's distribution, and a wrong rule is caught.

Two levels: the verifier alone against known distributions (goodness of fit), and whole generations against plain
``model.generate`` sampling (two-sample chi-square per position). All randomness is seeded, so these tests are
deterministic; the thresholds are loose enough for correct rules and far from what a wrong rule scores.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

import lookupdec
from lookupdec import LookupDrafter
from lookupdec import loop as loop_module
from lookupdec.verify import Verdict, verify_keyed, verify_sample

ALPHA = 1e-3


def _two_sample_p(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples of tokens come from one distribution; rare tokens pooled."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]], dtype=float)
    total = table.sum(axis=0)
    common = total >= 10
    rows = table[:, common]
    rest = table[:, ~common].sum(axis=1, keepdims=True)
    if rest.sum() > 0:
        rows = np.concatenate([rows, rest], axis=1)
    if rows.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(rows)[1])


def _fit_p(counts: Counter, p: torch.Tensor) -> float:
    observed = np.array([counts.get(k, 0) for k in range(len(p))], dtype=float)
    expected = p.double().numpy()
    expected = expected / expected.sum() * observed.sum()
    keep = expected > 0
    expected[keep] *= observed.sum() / expected[keep].sum()
    assert observed[~keep].sum() == 0, "sampled a token of probability zero"
    return float(stats.chisquare(observed[keep], expected[keep])[1])


def _always_accept(logits, draft, process=None, generator=None):
    """A wrong rule: keeps every drafted token, then samples the bonus token."""
    d = draft.shape[0]
    row = logits[d] if process is None else process(d, logits[d])
    return Verdict(d, int(torch.multinomial(torch.softmax(row, -1), 1, generator=generator)))


def _keyed(seeds=iter(range(10**9))):
    """verify_keyed with a new seed per call (the server's randomness: fixed by the seed and output position)."""
    return lambda logits, draft, process=None, generator=None: verify_keyed(logits, draft, process, next(seeds), 0)


@pytest.mark.parametrize("rule, should_pass", [(verify_sample, True), (_keyed(), True), (_always_accept, False)])
def test_verifier_commits_tokens_distributed_as_p(rule, should_pass):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=gen) * 1.5  # [d + 1, vocab], rows independent of the prefix
    p = torch.softmax(logits, -1)
    draft = torch.tensor([int(p[0].argmax()), int(p[1].argmax())])  # likely tokens, so runs get accepted
    first, second, bonus = Counter(), Counter(), Counter()
    for _ in range(12000):
        v = rule(logits, draft, None, gen)
        committed = draft[: v.accepted].tolist() + [v.token]
        first[committed[0]] += 1
        if len(committed) > 1:
            second[committed[1]] += 1
        if v.accepted == 2:
            bonus[v.token] += 1
    p_values = [_fit_p(first, p[0]), _fit_p(second, p[1]), _fit_p(bonus, p[2])]
    if should_pass:
        assert min(p_values) > ALPHA, p_values
    else:
        assert min(p_values) < 1e-12, p_values


def test_verifier_is_seeded():
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    draft = logits[:4].argmax(-1)
    runs = [
        [verify_sample(logits, draft, None, torch.Generator().manual_seed(s)) for _ in range(1)]
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    many_a = [verify_sample(logits, draft, None, g) for g in [torch.Generator().manual_seed(3)] for _ in range(50)]
    g = torch.Generator().manual_seed(3)
    many_b = [verify_sample(logits, draft, None, g) for _ in range(50)]
    assert many_a == many_b


# ---- whole generations -------------------------------------------------------------------------------------

STEPS = 4


@pytest.fixture(scope="module")
def peaky():
    return peaky_model()


def peaky_model():
    """A small random llama whose next-token distributions are peaky but not deterministic, with a prompt that is
    the model's own greedy cycle, so lookup drafts are accepted often and rejected sometimes."""
    from conftest import _tiny

    model = _tiny("llama", vocab_size=24, seed=1, peak=40.0)
    head = torch.tensor([[5, 9, 4, 17]])
    cont = model.generate(head, attention_mask=torch.ones_like(head), max_new_tokens=40, do_sample=False)
    prompt = cont[:, :40]
    return model, prompt


def _plain_samples(model, prompt, n, **kw):
    torch.manual_seed(1234)
    batch = prompt.repeat(n, 1)
    out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, max_new_tokens=STEPS, **kw)
    return _pad(out[:, prompt.shape[1]:].tolist())


def _pad(rows):
    """Rows that ended at EOS padded with the pad token (2), as batched plain generation pads them."""
    return torch.tensor([row + [2] * (STEPS - len(row)) for row in rows])


def _lookup_samples(model, prompt, n, **kw):
    gen = torch.Generator().manual_seed(99)
    drafter = LookupDrafter(adaptive=False, use_cache=False)
    rows = []
    drafted = 0
    for _ in range(n):
        out = lookupdec.generate(model, prompt, max_new_tokens=STEPS, do_sample=True, generator=gen,
                                 drafter=drafter, **kw)
        rows.append(out.sequences[0, prompt.shape[1]:].tolist())
        drafted += out.stats.accepted_tokens
    assert drafted > n // 2, "the test needs drafts that get accepted"
    return _pad(rows)


def _per_position_p(a: torch.Tensor, b: torch.Tensor) -> list:
    return [_two_sample_p(Counter(a[:, pos].tolist()), Counter(b[:, pos].tolist())) for pos in range(STEPS)]


WARPERS = [
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
    {"temperature": 0.7, "top_k": 6, "top_p": 0.9, "repetition_penalty": 1.2},
]


@pytest.mark.parametrize("warpers", WARPERS, ids=["plain", "warpers"])
def test_sampled_generations_match_plain_sampling(peaky, warpers):
    model, prompt = peaky
    n = 1500
    plain = _plain_samples(model, prompt, n, **warpers)
    ours = _lookup_samples(model, prompt, n, **warpers)
    p_values = _per_position_p(plain, ours)
    assert min(p_values) > ALPHA, p_values


def test_wrong_rule_is_caught_end_to_end(peaky, monkeypatch):
    model, prompt = peaky
    monkeypatch.setattr(loop_module, "verify_sample", _always_accept)
    plain = _plain_samples(model, prompt, 1500)
    wrong = _lookup_samples(model, prompt, 1500)
    assert min(_per_position_p(plain, wrong)) < 1e-6


def test_assistant_route_sampling_matches_plain(peaky):
    model, prompt = peaky
    n = 800
    plain = _plain_samples(model, prompt, n)
    torch.manual_seed(4321)
    drafter = LookupDrafter(adaptive=False, use_cache=False)
    rows = []
    for _ in range(n):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=STEPS,
                             assistant_model=drafter)
        rows.append(out[0, prompt.shape[1]:].tolist())
    p_values = _per_position_p(plain, _pad(rows))
    assert min(p_values) > ALPHA, p_values


def test_seeded_generation_is_reproducible(peaky):
    model, prompt = peaky
    runs = [
        lookupdec.generate(model, prompt, max_new_tokens=12, do_sample=True,
                           generator=torch.Generator().manual_seed(s)).sequences.tolist()
        for s in (5, 5)
    ]
    assert runs[0] == runs[1]
