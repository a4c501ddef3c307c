"""``lookupdec serve``: an OpenAI-compatible server whose drafts copy from each request's prompt, its output, the
other requests' outputs and its ``prediction`` (Predicted Outputs), on one batched, exact decoding loop.

- ``protocol``: request bodies checked into a :class:`~lookupdec.serve.protocol.Request`, responses and errors
  in OpenAI's shape (plain data, no model);
- ``scheduler``: requests joining the running batch, their prompts prefilled in chunks between its steps
  (:class:`~lookupdec.serve.scheduler.PrefillScheduler`);
- ``engine``: the thread that owns the model and the running batch, and each request's
  :class:`~lookupdec.serve.engine.Ticket`;
- ``text``: prompts as token ids, answers decoded incrementally and cut at stop strings;
- ``app``: the FastAPI routes, streaming, stop strings, authentication;
- ``observe``: what an operator sees: ``x-request-id`` on every answer, the access log, ``/metrics``;
- ``run``: loading the model and the rolling cache, calibrating, and running uvicorn until a signal
  (:func:`~lookupdec.serve.run.serve`).

Needs the ``serve`` extra: ``pip install 'lookupdec[serve]'``.
"""
