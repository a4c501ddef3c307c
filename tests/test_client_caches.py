"""Per-client rolling caches: one client's answers never become another client's drafts.

The drafter's shared cache lets every request draft from earlier requests' outputs. A server that several parties
use can scope it per client (``Drafter.start(client=...)``, :class:`lookupdec.cache.ClientCaches`) or turn it off
(``use_cache=False``). These tests count the drafted tokens that came from a cache, never timings.
"""

import numpy as np
import pytest

from lookupdec.cache import CacheConfig, ClientCaches
from lookupdec.drafter import Drafter

PROMPT = np.array([1, 2, 3], dtype=np.int32)
ANSWER = list(range(100, 160))  # an output that shares nothing with the prompt: only a cache can draft it


def _answer(drafter, **scope):
    """Generate ANSWER as a greedy target would, drafting from the session; returns the session, finished."""
    session = drafter.start(PROMPT, **scope)
    done = 0
    while done < len(ANSWER):
        draft = session.propose(len(ANSWER) - done)
        accepted = 0
        while accepted < draft.size and draft[accepted] == ANSWER[done + accepted]:
            accepted += 1
        tokens = ANSWER[done:done + accepted + 1]
        session.commit(tokens)
        done += len(tokens)
    session.finish()
    return session


def _drafter():
    # Fixed prices (no timed calibration): the verdicts below must not depend on this machine's clock.
    return Drafter(calibrate=False)


def test_a_second_client_drafts_nothing_from_the_first_clients_answer():
    drafter = _drafter()
    first = _answer(drafter, client="alice")
    assert first.cache_drafted == 0  # nothing earlier to draft from
    bob = _answer(drafter, client="bob")
    assert bob.cache_drafted == 0  # alice's answer is in alice's cache only
    again = _answer(drafter, client="alice")
    assert again.cache_accepted > len(ANSWER) // 2  # alice drafts from her own earlier answer
    shared = _answer(drafter)
    assert shared.cache_drafted == 0  # nor does a request on the shared cache see either client's answers
    assert len(drafter.cache) == len(PROMPT[-drafter.cache.max_n:]) + len(ANSWER)  # the shared one fed only by it


def test_the_shared_cache_is_shared_and_no_cache_is_none():
    drafter = _drafter()
    _answer(drafter)
    assert _answer(drafter).cache_accepted > len(ANSWER) // 2  # today's default: every request shares
    off = _answer(drafter, use_cache=False)
    assert off.cache_drafted == 0  # it drafts from no cache...
    before = len(drafter.cache)
    _answer(drafter, use_cache=False)
    assert len(drafter.cache) == before and len(drafter.clients) == 0  # ...and feeds none


def test_a_client_without_a_cache_allocates_nothing():
    drafter = _drafter()
    session = drafter.start(PROMPT, client="mallory")
    session.commit([100, 101])
    assert session.offer(8).tokens.size == 0
    assert len(drafter.clients) == 0


def test_client_caches_keep_to_their_budget_dropping_the_least_recently_used():
    config = CacheConfig(max_tokens=100, min_n=2, max_n=4)
    caches = ClientCaches(config, max_tokens=100)
    for name in ("a", "b", "c"):
        caches.add(name, np.arange(40, dtype=np.int32) + 1000 * ord(name))
    # 120 tokens held by three clients of 40 > 100: the least recently used (a) went, whole.
    assert caches.get("a") is None and len(caches.get("b")) == 40 and len(caches.get("c")) == 40
    caches.get("b")  # b is now the most recently used
    caches.add("d", np.arange(40, dtype=np.int32))
    assert caches.get("c") is None and caches.get("b") is not None and caches.get("d") is not None
    # One client alone may fill the budget; its own cache is never dropped to make room for itself.
    caches.add("d", np.arange(90, dtype=np.int32) + 5000)
    assert caches.get("d") is not None and len(caches) == 1


def test_client_names_are_kept_as_hashes():
    caches = ClientCaches(CacheConfig(max_tokens=100, min_n=2, max_n=4), max_tokens=100)
    huge = "x" * 1_000_000
    caches.add(huge, [1, 2, 3, 4])
    assert all(len(key) == 64 for key in caches._caches)  # a fixed size, whatever the name's
    assert caches.get(huge) is not None and caches.get("x") is None


def test_a_client_must_be_a_string():
    with pytest.raises(TypeError, match="client must be a string"):
        _drafter().start(PROMPT, client=5)
