"""Whose earlier answers a request on ``lookupdec serve`` drafts from (``--cache-scope``): its client's (OpenAI's
``user``), everyone's, or nobody's. Counted by the drafted tokens each answer took from a rolling cache
(``usage.lookup.cache_drafted_tokens``), never by timing. The vLLM engine's counterpart is in tests/test_vllm.py.
"""

import asyncio

import pytest
import torch
from click.testing import CliRunner
from helpers_costs import fixed_costs, nearly_free
from test_serve_engine import _greedy, _outcome, _req

from lookupdec import cli
from lookupdec.drafter import Drafter, DrafterConfig
from lookupdec.serve.engine import Engine, Ticket


def _answer(engine, prompt, budget, user) -> tuple:
    """One request, alone, then released as the web layer releases it (its answer joins the rolling cache)."""
    async def main():
        ticket = Ticket(_req(user=user), prompt, None, budget, asyncio.get_running_loop())
        engine.submit(ticket)
        outcome = await asyncio.wait_for(_outcome(ticket), 300)
        await asyncio.get_running_loop().run_in_executor(None, ticket.release)
        return outcome

    return asyncio.run(main())


def _random_prompt(model, seed):
    # Nothing in it to copy from itself: an earlier answer to it is the only draft there is.
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (40,), generator=generator).tolist()


@pytest.mark.parametrize("scope", ["user", "shared", "off"])
def test_with_the_user_scope_a_client_never_drafts_from_another_clients_answer(tiny_model, scope):
    prompt = _random_prompt(tiny_model, 41)
    expected = _greedy(tiny_model, prompt, 30)
    # Nearly free passes (set by hand, not timed): a cache's copy is drafted wherever there is one.
    drafter = fixed_costs(Drafter(DrafterConfig(calibrate=False, use_cache=scope != "off")), nearly_free)
    engine = Engine(tiny_model, None, drafter, cache_scope=scope)
    engine.start()
    try:
        drafted = {}
        for name, user in (("first", "alice"), ("other", "bob"), ("anonymous", None), ("again", "alice")):
            tokens, kind, summary = _answer(engine, prompt, 30, user)
            assert kind == "done" and tokens == expected  # the answer is the same whatever was drafted
            drafted[name] = summary["cache_drafted_tokens"]
    finally:
        engine.stop(timeout=5)
    assert drafted["first"] == 0
    if scope == "user":
        assert drafted["other"] == drafted["anonymous"] == 0 and drafted["again"] > 0
    elif scope == "shared":
        assert drafted["other"] > 0 and drafted["anonymous"] > 0 and drafted["again"] > 0
    else:
        assert drafted["other"] == drafted["anonymous"] == drafted["again"] == 0


def test_a_bad_scope_is_refused(tiny_model):
    with pytest.raises(ValueError, match="cache_scope must be one of user, shared, off"):
        Engine(tiny_model, None, None, cache_scope="tenant")


def test_the_cache_file_needs_a_cache():
    result = CliRunner().invoke(cli.main, ["serve", "--cache", "c.json", "--cache-scope", "off", "--model",
                                           "/nonexistent"], catch_exceptions=False)
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --cache keeps the rolling cache of earlier answers, and --cache-scope " \
                                    "off keeps none"


def test_the_scope_reaches_vllms_proposer(monkeypatch):
    from lookupdec.vllm import launch

    seen = []
    monkeypatch.setattr(launch, "run", lambda options, say: seen.append(options) or 0)
    result = CliRunner().invoke(cli.main, ["serve", "--engine", "vllm", "--cache-scope", "shared"],
                                catch_exceptions=False)
    assert result.exit_code == 0 and seen[0].proposer.cache_scope == "shared"
    assert launch.additional_config(seen[0])["lookupdec"]["cache_scope"] == "shared"
