"""benchmarks/oracle.py: the oracle keeps to lookupdec's driver (``Drafter.start``'s parameters, the ``Session``
protocol), and on lookupdec's own loop it gives plain greedy's tokens in the fewest passes.

Tests of the tools, not of the product (``python -m pytest -q benchmarks research``)."""

import argparse

import torch

import lookupdec
from benchmarks import run
from benchmarks.oracle import OracleDrafter, OracleSession, protocol_mismatches
from benchmarks.test_run import _tiny
from lookupdec.drafter import Drafter


def test_the_oracle_follows_the_drivers_protocol():
    assert protocol_mismatches(OracleDrafter, OracleSession) == []


def test_a_stand_in_that_drifted_is_named():
    # The oracle as it stood before Drafter.start took reproducible= (and Session.finish took generated=).
    class Old(Drafter):
        def start(self, prompt, eos_ids=()):
            return OldSession()

    class OldSession(OracleSession):
        def __init__(self):
            pass

        def finish(self):
            pass

    found = protocol_mismatches(Old, OldSession)
    assert len(found) == 2
    assert found[0].startswith("Old.start(self, prompt, eos_ids=()) is not Drafter.start(") and "reproducible" in \
        found[0]
    assert found[1].startswith("OldSession.finish(self) is not Session.finish(self, generated")


def test_the_oracle_gives_greedys_tokens_in_the_fewest_passes():
    model = _tiny()
    ids = torch.tensor([[5, 9, 4, 17, 5, 9, 4, 30]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
        answer = plain.tolist()
        out = lookupdec.generate(model, ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                 drafter=OracleDrafter(answer, max_draft=8))
    assert out.sequences[0, ids.shape[1]:].tolist() == answer
    # The prefill yields the first token; then every pass drafts 8 right tokens and adds its own: 24 = 1 + 9 + 9 + 5.
    assert out.stats.target_passes == 4


def test_the_oracle_runs_where_the_loop_passes_every_keyword():
    # Sampling with a seeded generator is where the loop passes start(..., reproducible=True).
    model = _tiny()
    ids = torch.tensor([[5, 9, 4, 17]])
    with torch.inference_mode():
        out = lookupdec.generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True,
                                 generator=torch.Generator().manual_seed(0), drafter=OracleDrafter([1] * 6, 4))
    assert out.sequences.shape[1] <= ids.shape[1] + 6


def test_run_times_the_oracle_beside_greedy():
    # run.py's own path for --systems greedy oracle, on a tiny model.
    model = _tiny()
    counter = run.PassCounter(model)
    args = argparse.Namespace(max_new_tokens=16, sample=False, seed=0, drafter={})
    ids = torch.tensor([[5, 9, 4, 17, 5, 9]])
    greedy, answer = run.run_system("greedy", model, ids, args, counter, None, (20, 3))
    oracle, tokens = run.run_system("oracle", model, ids, args, counter, answer, (20, 3))
    assert tokens == answer and oracle.identical and oracle.new_tokens == greedy.new_tokens == 16
    assert oracle.passes < greedy.passes == 16
