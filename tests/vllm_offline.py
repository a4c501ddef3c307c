"""Run vLLM offline on a few chat requests and print the answers as JSON; ``tests/test_vllm.py`` runs it in a
process of its own per engine configuration (vLLM's engine does not come back cleanly within one process).

    python tests/vllm_offline.py '{"model": FOLDER, "requests": [...], "spec": {...} or null, "scenarios": {...}}'

With ``scenarios`` (lookupdec's proposer only) vLLM's engine runs in this process, so the proposer's sessions can be
counted, and after the requests two scenarios run one request at a time:

- ``scope``: the same open-ended request from clients alice, bob, alice again (``vllm_xargs`` client, as the
  middleware sets it from OpenAI's ``user``): the tokens each drafted and had accepted from a rolling cache;
- ``seed``: a sampled request with a seed (at its ``temperature``, 1 if none), then the same prompt unseeded (its
  answer joins the cache), then the seeded one again: both seeded answers, the tokens drafted for the second, what
  the second drafted from the rolling cache, and for each seeded answer the drafts the proposer gave it (after how
  many output tokens, which tokens).
"""

import json
import os
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    scenarios = job.get("scenarios")
    if scenarios:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine, and so the proposer, in this process
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, max_num_seqs=4, seed=0,
              speculative_config=job.get("spec"), disable_log_stats=False, enforce_eager=True)
    sessions = _recorded_sessions() if scenarios else []
    tokenizer = llm.get_tokenizer()
    conversations, params = [], []
    for request in job["requests"]:
        conversations.append(request["messages"])  # chat-templated as vLLM's server does it
        extra = None
        if request.get("prediction") is not None:
            from lookupdec.vllm import PREDICTION_ARG

            extra = {PREDICTION_ARG: tokenizer(request["prediction"], add_special_tokens=False)["input_ids"]}
        params.append(SamplingParams(temperature=request.get("temperature", 0.0), max_tokens=request["max_tokens"],
                                     seed=request.get("seed"), n=1, extra_args=extra, logprobs=2))
    # Each request alone (as a server answers one client at a time), then all together in one batch: vLLM's own
    # plain decoding may round differently between batch shapes, so each is compared with its own kind.
    alone = [llm.chat([conversation], [param], use_tqdm=False)[0] for conversation, param in zip(conversations, params)]
    batched = llm.chat(conversations, params, use_tqdm=False)
    result = {"token_ids": [list(o.outputs[0].token_ids) for o in alone],
              "texts": [o.outputs[0].text for o in alone],
              "top": [_top(o) for o in alone],
              "batched_token_ids": [list(o.outputs[0].token_ids) for o in batched],
              "batched_top": [_top(o) for o in batched],
              "metrics": _spec_metrics(llm)}
    if scenarios:
        result["scope"] = _scope(llm, sessions, scenarios["scope"])
        result["seed"] = _seed(llm, sessions, scenarios["seed"])
    print("RESULT " + json.dumps(result))


def _recorded_sessions() -> list:
    """Every drafting session the proposer starts from now on, in order. (Imported only once the engine is up:
    vLLM's worker start-up scans every module loaded in its process, and trips over numba's, which lookupdec's
    drafter loads.)"""
    from lookupdec.vllm.proposer import LookupProposer

    sessions = []
    start = LookupProposer._start

    def recording(self, info, tokens, n):
        tracked = start(self, info, tokens, n)
        sessions.append(tracked.session)
        return tracked

    LookupProposer._start = recording
    return sessions


def _spec_metrics(llm) -> dict:
    return {metric.name: metric.value for metric in llm.get_metrics()
            if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value")}


def _scope(llm, sessions, request) -> list:
    from vllm import SamplingParams

    from lookupdec.vllm import CLIENT_ARG

    out = []
    for client in ("alice", "bob", "alice"):
        before = len(sessions)
        param = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], extra_args={CLIENT_ARG: client})
        answer = llm.chat([request["messages"]], [param], use_tqdm=False)[0]
        session = sessions[before]  # this request's, started after the one before had finished
        out.append({"client": client, "tokens": len(answer.outputs[0].token_ids), "text": answer.outputs[0].text,
                    "cache_drafted": session.cache_drafted, "cache_accepted": session.cache_accepted})
    return out


def _seed(llm, sessions, request) -> dict:
    from vllm import SamplingParams

    from lookupdec.vllm.proposer import LookupProposer

    drafts = {}  # id(session) -> [[output tokens before the draft, drafted tokens], ...]
    own_length = LookupProposer._own_length

    def recording(self, entry):
        length = own_length(self, entry)
        tracked = self._requests[entry[1]]
        drafts.setdefault(id(entry[2]), []).append([tracked.seen - tracked.info.prompt_len,
                                                    entry[3].tokens[:length].tolist()])
        return length

    LookupProposer._own_length = recording

    def run(seed):
        before = len(sessions)
        param = SamplingParams(temperature=request.get("temperature", 1.0), max_tokens=request["max_tokens"], seed=seed)
        answer = list(llm.chat([request["messages"]], [param], use_tqdm=False)[0].outputs[0].token_ids)
        return answer, sessions[before]

    first, first_session = run(7)
    run(None)  # an unseeded answer to the same prompt: the rolling cache now holds it, the cost fit moved on
    drafted = _spec_metrics(llm).get("vllm:spec_decode_num_draft_tokens", 0)
    second, second_session = run(7)
    return {"first": first, "second": second,
            "drafted": _spec_metrics(llm).get("vllm:spec_decode_num_draft_tokens", 0) - drafted,
            "second_cache_drafted": second_session.cache_drafted,
            "first_drafts": drafts.get(id(first_session), []), "second_drafts": drafts.get(id(second_session), [])}


def _top(output) -> list:
    """Per output position, {token id: logprob} of the two likeliest tokens (and the one chosen)."""
    return [{str(token): lp.logprob for token, lp in position.items()} for position in output.outputs[0].logprobs]


if __name__ == "__main__":
    main()
