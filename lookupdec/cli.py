"""The ``lookupdec`` command. ``lookupdec reformat FILE`` rewrites or edits a YAML config with a local model.

This layer only parses arguments and reports: the application is :mod:`lookupdec.reformat`, whose errors carry
their exit code and become a one-line message (perhaps with indented detail lines) here.

Exit codes: 0 success; 1 the model's output was rejected (nothing written; with several files, nothing for the
rejected ones); 2 usage or input error, including a model that cannot be loaded (nothing written); 130
interrupted (nothing written).
"""

from __future__ import annotations

import os
from pathlib import Path
from sys import float_info

import click

from . import __version__
from .cache import CACHE_SCOPES
from .reformat.run import (
    DEFAULT_BATCH,
    ReformatOptions,
    Trace,
    output_for,
    reformat_files,
)
from .reformat.validate import EXIT_REJECTED, ReformatError

# --dtype: lookupdec's default pick, the checkpoint's own (transformers' "auto"), or a precision.
DTYPE_CHOICES = ["default", "auto", "fp32", "bf16", "fp16"]

EXIT_OK = 0
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

EXIT_CODES_HELP = """\b
Exit codes:
  0    success
  1    the model's output was rejected (it did not validate); nothing was written
       (with several files: nothing for the rejected ones)
  2    usage or input error (bad option, unreadable/invalid/empty/too large file,
       model that cannot be loaded); nothing was written
  130  interrupted (Ctrl-C); nothing was written
"""


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_HELP)
@click.version_option(__version__, "--version", prog_name="lookupdec")
def main():
    """lookupdec: exact draft-free speculative decoding, and a config-editing command built on it."""


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("files", metavar="FILE...", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--instruction", "-i", metavar="TEXT", help="The edit to make, e.g. \"change the port to 9090\". "
              "Without it the file is reformatted, keeping every key, value and comment.")
@click.option("--to", "to", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True,
              help="Output format. The model always works on YAML (it is far more reliable there); JSON is "
                   "written from the validated result.")
@click.option("-o", "--output", type=click.Path(path_type=Path), metavar="OUT",
              help="Write the result to OUT instead of stdout; with several files, OUT is a folder that gets "
                   "each result under its file's name.")
@click.option("--in-place", is_flag=True, help="Replace FILE atomically, keeping the original as FILE.bak.")
@click.option("--batch", type=click.IntRange(min=1, max=64), default=DEFAULT_BATCH, show_default=True,
              metavar="N", help="Sections (of all files) the model works on together in one batch; 1 turns "
                               "batching off. Outputs do not depend on it, only speed does.")
@click.option("--model", "model_name", metavar="NAME_OR_PATH", default=None,
              help="Hub id, local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct (offline).")
@click.option("--device", default="auto", show_default=True, metavar="DEVICE",
              help="Where the model runs: auto (CUDA if available, else the CPU), cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="default", show_default=True,
              help="Model precision: default is bf16 on CUDA and fp32 on the CPU; auto is the checkpoint's own, as "
                   "in transformers. Outputs are token-identical to plain decoding in fp32; in bf16/fp16 they may "
                   "differ from it at near-ties (see the README).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), metavar="N", default=None,
              help="Token budget per section; a file that needs more is processed in smaller sections. "
                   "Default: 1.5x each section's length + 32.")
@click.option("--no-lookup", is_flag=True, help="Decode plainly (model.generate) instead of with lookup drafts.")
@click.option("--compare", is_flag=True, help="Also time plain decoding and transformers' prompt lookup on the "
              "same prompts and print the speedups.")
@click.option("--keep-going", is_flag=True, help="With --instruction: keep a section whose output fails "
              "validation as it was, instead of stopping.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the result (no progress, summary or notes).")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), metavar="OUT.html",
              help="Also write an HTML trace of the model's work, one block per section: accepted draft tokens "
                   "green, the first rejected one red, the model's own tokens plain. Written when the result "
                   "validated and when it was rejected (to see why).")
def reformat(files, instruction, to, output, in_place, batch, model_name, device, dtype, max_new_tokens, no_lookup,
             compare, keep_going, quiet, trace_path):
    """Reformat or edit the YAML file FILE with a local model, validating what it writes.

    Without --instruction the file is rewritten with consistent formatting, section by section; the result must
    load to the same data as FILE, and a section whose output does not is kept as it was. With --instruction
    the edit is applied and the result must parse. Nothing is written unless the result validated: it goes to
    stdout, to OUT with -o, or replaces FILE with --in-place.

    Several files are edited together, their sections batched, and need --in-place or -o FOLDER; each file is
    validated and written on its own, and the exit code is 1 if any was rejected. With --instruction, a rejected
    section stops the whole run (nothing is written) unless --keep-going.

    \b
    Examples:
      lookupdec reformat examples/configs/service.yaml
      lookupdec reformat service.yaml -i "change the server port to 9090" --in-place
      lookupdec reformat service.yaml --to json -o service.json
      lookupdec reformat service.yaml --trace trace.html -o /dev/null
      lookupdec reformat a.yaml b.yaml c.yaml --in-place
    """
    if output is not None and in_place:
        raise click.UsageError("use either -o/--output or --in-place, not both")
    if compare and no_lookup:
        raise click.UsageError("--compare times lookup decoding against the others; drop --no-lookup")
    if instruction is not None and not instruction.strip():
        raise click.UsageError("--instruction is empty")
    if trace_path is not None and no_lookup:
        raise click.UsageError("--trace records lookup decoding's passes; drop --no-lookup")
    if len(files) > 1 and output is None and not in_place:
        raise click.UsageError("several files need --in-place or -o FOLDER")
    if len(files) > 1 and output is not None and not output.is_dir():
        raise click.UsageError(f"-o {click.format_filename(str(output))}: with several files, -o names an "
                               "existing folder")
    if len({os.path.realpath(f) for f in files}) < len(files):
        raise click.UsageError("a file is named twice")
    if len(files) > 1 and output is not None:
        targets = [os.path.realpath(output_for(f, output, True, to)) for f in files]
        if len(set(targets)) < len(targets):
            raise click.UsageError("two files would be written to the same name in the -o folder")
        if set(targets) & {os.path.realpath(f) for f in files}:
            raise click.UsageError("-o would overwrite an input file; use --in-place to replace inputs")
    options = ReformatOptions(instruction=instruction, to=to, output=output, in_place=in_place, batch=batch,
                              model=model_name, device=device, dtype=dtype, max_new_tokens=max_new_tokens,
                              lookup=not no_lookup, compare=compare, keep_going=keep_going, quiet=quiet)
    say = (lambda line: None) if quiet else (lambda line: click.echo(line, err=True))
    trace = Trace(trace_path, files) if trace_path is not None else None
    try:
        reformat_files(files, options, say, show=lambda text: click.echo(text, nl=False), trace=trace)
    except ReformatError as err:
        for cause in err.causes:  # with several files: each rejected file's reason, before the sum
            click.echo(f"error: {cause}", err=True)
        if trace is not None and err.code == EXIT_REJECTED:  # a rejection is worth seeing in the trace
            try:
                trace.save(say)
            except ReformatError as trace_err:
                click.echo(f"error: {trace_err}", err=True)
        click.echo(f"error: {err}", err=True)
        raise click.exceptions.Exit(err.code) from None
    except KeyboardInterrupt:
        click.echo("\ninterrupted; nothing was written", err=True)
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


class NumberOr(click.ParamType):
    """A number of type ``kind`` in ``[low, high]``, or the word ``word`` (read as None)."""

    def __init__(self, name: str, kind, low, high, word: str, what: str):
        self.name, self.kind, self.low, self.high, self.word, self.what = name, kind, low, high, word, what

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, self.kind):
            return value
        if str(value).lower() == self.word:
            return None
        try:
            number = self.kind(value)
        except ValueError:
            number = None
        if number is None or not self.low <= number <= self.high:
            self.fail(f"{value!r} is not {self.what} or {self.word}", param, ctx)
        return number


SLOWDOWN_BOUND = NumberOr("fraction|none", float, 0.0, float_info.max, "none", "a fraction >= 0")
PREFILL_THREADS = NumberOr("n|auto", int, 0, 1024, "auto", "a number of threads (0 to 1024)")


SERVE_EXIT_HELP = """\b
Exit codes:
  0    stopped by SIGTERM or Ctrl-C: requests in flight finished (or, past
       --drain-timeout, answered with a 503), cache saved
  2    usage error, or a model or extra that cannot be loaded
  With --engine vllm, vLLM's own exit code once it has started.
"""


SERVED_NAME = "--served-model-name"


class _ServeCommand(click.Command):
    """``serve``, which takes ``--served-model-name A B C`` as vLLM does (the words after the option, up to the next
    option or ``--``), as well as the option repeated."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, spread_names(args))


def spread_names(args: list) -> list:
    """``--served-model-name A B`` written as ``--served-model-name A --served-model-name B`` (what click reads);
    nothing after ``--`` (vLLM's arguments) is touched."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        out.append(arg)
        i += 1
        if arg == "--":
            return out + list(args[i:])
        if arg == SERVED_NAME and i < len(args):
            out.append(args[i])  # the first value, whatever it is, as click would take it
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                out += [SERVED_NAME, args[i]]
                i += 1
    return out


def _names(ctx, param, value):
    if any(not name.strip() for name in value):
        raise click.BadParameter("a served model name is empty")
    return tuple(dict.fromkeys(value))


@main.command(cls=_ServeCommand, epilog=SERVE_EXIT_HELP)
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default="transformers", show_default=True,
              help="transformers: lookupdec's own batch loop (no other dependency). vllm: vLLM's OpenAI server with "
                   "lookupdec's proposer and Predicted Outputs (needs vLLM installed; arguments after -- go to "
                   "vLLM; see docs/vllm.md).")
@click.option("--model", "model_name", metavar="NAME_OR_PATH", default=None,
              help="Hub id, local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct (offline). "
                   "Requests name it by this value (default: smollm2) unless --served-model-name is given.")
@click.option(SERVED_NAME, "served_names", metavar="NAME [NAME ...]", multiple=True, callback=_names,
              help="The names requests may give the model (all listed by /v1/models); answers carry the first. "
                   "For clients that send Predicted Outputs only to OpenAI's model names, e.g. "
                   "--served-model-name smollm2 gpt-4.1-mini for Obsidian Smart Composer.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1, max=256), default=8, show_default=True, metavar="N",
              help="Requests decoded together; later ones wait in the queue.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True, metavar="N",
              help="Requests allowed to wait; past that, 429 with Retry-After.")
@click.option("--cache", "cache_path", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
              help="Load the rolling cache of earlier outputs from FILE, and save it there on shutdown.")
@click.option("--api-key", metavar="KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (default: $LOOKUPDEC_API_KEY; none if unset).")
@click.option("--device", default="auto", show_default=True, metavar="DEVICE",
              help="auto (CUDA if available, else the CPU), cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="default", show_default=True,
              help="default is bf16 on CUDA and fp32 on the CPU; auto is the checkpoint's own (on vLLM: vLLM's "
                   "auto).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM or Ctrl-C, how long requests in flight get to finish; those still running are then "
                   "answered with a 503 (a stream: an error event, then [DONE]).")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="One line per request on stderr (logger lookupdec.access): its x-request-id, status, tokens, "
                   "passes, drafted and accepted tokens, time. With --engine vllm: uvicorn's access log.")
@click.option("--no-calibrate", is_flag=True, help="Skip measuring the pass cost at startup (once per machine, "
              "cached); the drafter then fits a straight line as it goes.")
@click.option("--cache-scope", type=click.Choice(list(CACHE_SCOPES)), default="user", show_default=True,
              help="Whose earlier answers a request drafts from: its client's (OpenAI's 'user' field; requests "
                   "without one share), everyone's (fastest; but a client who times its answers could tell what "
                   "others generated), or none. Answers are the same either way.")
@click.option("--max-slowdown", type=SLOWDOWN_BOUND, default="0.05", show_default=True, metavar="FRACTION|none",
              help="Never slower, per request: drafts (a request's own, or others' in the same batch) may make no "
                   "request more than this fraction slower than plain decoding (plus under one step). none: "
                   "throughput first, no such bound.")
@click.option("--prefill-threads", type=PREFILL_THREADS, default="auto", show_default=True, metavar="N|auto",
              help="On a CPU, torch threads of a worker that prefills new prompts beside the decoding steps, so "
                   "that running requests do not wait for them. 0: prefill between the steps. auto: the cores the "
                   "steps leave free (torch's threads; set OMP_NUM_THREADS to leave some), up to as many as the "
                   "steps use.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_ARGS...]")
def serve(engine, model_name, served_names, host, port, max_batch, max_queue, cache_path, api_key, device, dtype,
          drain_timeout, access_log, no_calibrate, cache_scope, max_slowdown, prefill_threads, vllm_args):
    """Serve the model over OpenAI's API (chat and completions, streaming), honouring Predicted Outputs.

    Every answer carries an x-request-id header (the client's own, else the completion's id); GET /metrics gives
    Prometheus metrics and GET /health the server's state, both without the API key.

    \b
    Examples:
      lookupdec serve
      lookupdec serve --port 8080 --max-batch 16 --cache ~/.cache/lookupdec/serve-cache.json
      lookupdec serve --served-model-name smollm2 gpt-4.1-mini
    """
    if engine == "vllm":
        _serve_vllm(model_name, served_names, host, port, max_batch, api_key, dtype, access_log, vllm_args,
                    {"cache_scope": cache_scope, "max_slowdown": max_slowdown},
                    not_applicable={"--max-queue": max_queue != 64, "--cache": cache_path is not None,
                                    "--device": device != "auto", "--drain-timeout": drain_timeout != 30.0,
                                    "--no-calibrate": no_calibrate,
                                    "--prefill-threads": prefill_threads is not None})
        return
    if vllm_args:
        click.echo(f"error: unexpected arguments {' '.join(vllm_args)!r} (arguments after -- are vLLM's, for "
                   "--engine vllm)", err=True)
        raise click.exceptions.Exit(2)
    from .serve.run import ServeError, ServeOptions
    from .serve.run import serve as run_server

    options = ServeOptions(model=model_name, host=host, port=port, max_batch=max_batch, max_queue=max_queue,
                           cache=cache_path, api_key=api_key, device=device, dtype=dtype,
                           drain_timeout=drain_timeout, calibrate=not no_calibrate, cache_scope=cache_scope,
                           max_slowdown=max_slowdown, prefill_threads=prefill_threads,
                           served_model_names=served_names, access_log=access_log)
    try:
        run_server(options, say=lambda line: click.echo(line, err=True))
    except ServeError as err:
        click.echo(f"error: {err}", err=True)
        raise click.exceptions.Exit(2) from None


def _serve_vllm(model_name, served_names, host, port, max_batch, api_key, dtype, access_log, vllm_args, proposer,
                not_applicable) -> None:
    given = [name for name, is_set in not_applicable.items() if is_set]
    if given:
        click.echo(f"error: {', '.join(given)} apply to --engine transformers only; vLLM's own settings go after "
                   "-- (docs/vllm.md)", err=True)
        raise click.exceptions.Exit(2)
    from .vllm import ProposerOptions
    from .vllm.launch import LaunchError, VllmOptions, run

    api_key = api_key or os.environ.get("LOOKUPDEC_API_KEY") or None
    options = VllmOptions(model=model_name, host=host, port=port, max_batch=max_batch, api_key=api_key,
                          dtype=dtype, proposer=ProposerOptions(**proposer),
                          served_model_names=served_names, access_log=access_log, extra=list(vllm_args))
    try:
        code = run(options, say=lambda line: click.echo(line, err=True))
    except LaunchError as err:
        click.echo(f"error: {err}", err=True)
        raise click.exceptions.Exit(2) from None
    raise click.exceptions.Exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
