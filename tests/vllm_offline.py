"""Run vLLM offline on a few chat requests and print the answers as JSON; ``tests/test_vllm.py`` runs it in a
process of its own per engine configuration (vLLM's engine does not come back cleanly within one process).

    python tests/vllm_offline.py '{"model": FOLDER, "requests": [...], "spec": {...} or null}'
"""

import json
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, max_num_seqs=4, seed=0,
              speculative_config=job.get("spec"), disable_log_stats=False, enforce_eager=True)
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
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value"):
            metrics[metric.name] = metric.value
    print("RESULT " + json.dumps({"token_ids": [list(o.outputs[0].token_ids) for o in alone],
                                  "texts": [o.outputs[0].text for o in alone],
                                  "top": [_top(o) for o in alone],
                                  "batched_token_ids": [list(o.outputs[0].token_ids) for o in batched],
                                  "batched_top": [_top(o) for o in batched],
                                  "metrics": metrics}))


def _top(output) -> list:
    """Per output position, {token id: logprob} of the two likeliest tokens (and the one chosen)."""
    return [{str(token): lp.logprob for token, lp in position.items()} for position in output.outputs[0].logprobs]


if __name__ == "__main__":
    main()
