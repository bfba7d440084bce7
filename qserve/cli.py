"""The `qserve` command line."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import click

from qserve.errors import QServeError

logger = logging.getLogger("qserve")
# Third-party loggers that warn at import about things a qserve user cannot act on: torchao
# (pulled in by transformers where installed) about its optional CUDA libraries, and torch's
# pytree about torchao registering enums the deprecated way. Errors still show.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


class _GroupSize(click.ParamType):
    """--group-size: an integer (checked by the quantizer) or "auto"."""

    name = "group_size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not an integer or auto", param, ctx)


GROUP_SIZE = _GroupSize()


class _Group(click.Group):
    """Turns QServeError into one line on stderr and exit status 2, never a traceback; any
    other failure is one line too (exit 1), its traceback shown only with -v."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except QServeError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(2)
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            if logger.isEnabledFor(logging.DEBUG):  # -v
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            click.echo(f"error: {type(exc).__name__}: {first} (-v shows where)", err=True)
            ctx.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="qserve")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def cli(verbose: bool) -> None:
    """Quantize Hugging Face LLMs and serve them on a paged-KV engine."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.ERROR)


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every command that runs the engine (generate, serve, eval)."""
    options = [
        click.argument("model", required=False),
        click.option(
            "--recipe", default=None, help="Recipe name, YAML path or auto; explicit flags win."
        ),
        click.option(
            "--dtype",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            help="Activation dtype; auto: bf16 on CUDA and AMX/AVX512-BF16 CPUs, else fp32.",
        ),
        click.option("--device", default="cpu", show_default=True),
        click.option(
            "--kv-cache-memory",
            default="1GiB",
            show_default=True,
            help="Memory for KV pages, e.g. 2GiB, 512MiB.",
        ),
        click.option(
            "--kv-cache-dtype",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "fp8_e4m3", "fp8_e5m2"]),
        ),
        click.option(
            "--block-size",
            default=16,
            show_default=True,
            type=click.IntRange(1),
            help="Tokens per KV block.",
        ),
        click.option("--max-num-seqs", default=64, show_default=True, type=click.IntRange(1)),
        click.option(
            "--max-num-batched-tokens",
            default=2048,
            show_default=True,
            type=click.IntRange(1),
            help="Token budget of one step.",
        ),
        click.option(
            "--max-model-len",
            default=None,
            type=click.IntRange(2),
            help="Context limit (prompt + output); default: the model's.",
        ),
        click.option("--no-prefix-caching", is_flag=True, help="Disable prefix caching."),
        click.option("--threads", default=None, type=click.IntRange(1), help="torch CPU threads."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


class _Bytes(click.ParamType):
    """A size such as 8MiB, 512MB or 1048576 (bytes)."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        from qserve.config import parse_memory

        try:
            return value if isinstance(value, int) else parse_memory(value)
        except QServeError as exc:
            self.fail(str(exc), param, ctx)


def limit_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """`qserve serve`'s request limits, one option per RequestLimits field (flag, help and
    default from the field), so a new limit is written once."""
    from qserve.server.limits import RequestLimits

    types = {"count": click.IntRange(1), "bytes": _Bytes()}
    for f in reversed(fields(RequestLimits)):
        meta = f.metadata
        shown = f"{f.default // 2**20}MiB" if meta["kind"] == "bytes" else True
        func = click.option(meta["flag"], f.name, default=f.default, show_default=shown,
                            type=types[meta["kind"]], help=meta["help"])(func)  # fmt: skip
    return func


def engine_config(**kw: Any) -> Any:
    """EngineConfig from the command's options, merged with `--recipe` (explicit flags win)."""
    from qserve.config import EngineConfig

    kw = _with_recipe(kw, "serve")
    return EngineConfig(
        model=kw["model"],
        dtype=kw["dtype"],
        device=kw["device"],
        kv_cache_memory=kw["kv_cache_memory"],
        kv_cache_dtype=kw["kv_cache_dtype"],
        block_size=kw["block_size"],
        max_num_seqs=kw["max_num_seqs"],
        max_num_batched_tokens=kw["max_num_batched_tokens"],
        max_model_len=kw["max_model_len"],
        enable_prefix_caching=not kw["no_prefix_caching"],
        num_threads=kw["threads"],
    )


def _with_recipe(kw: dict[str, Any], section: str) -> dict[str, Any]:
    """Apply the recipe named by kw["recipe"] (if any) to a command's options and log the
    effective settings. `section` is "serve" or "quantize"."""
    from qserve.recipe import apply_recipe, format_settings, resolve_recipe, section_values

    kw = dict(kw)
    name = kw.pop("recipe", None)
    if not name:
        return kw
    recipe = resolve_recipe(name)
    values = recipe.serve_values if section == "serve" else section_values(recipe.quantize)
    kw, origin = apply_recipe(values, kw, click.get_current_context())
    shown = {k: v for k, v in kw.items() if k in origin}
    logger.info("recipe %s; effective settings: %s", recipe.name, format_settings(shown, origin))
    kw["_recipe"] = recipe
    return kw


@cli.command()
@engine_options
@click.option(
    "-p",
    "--prompt",
    "prompts",
    multiple=True,
    required=True,
    help="Prompt text; repeat for a batch.",
)
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--min-p", default=0.0, show_default=True, type=float)
@click.option("--seed", default=None, type=int)
@click.option("--stop", multiple=True, help="Stop string; repeatable.")
@click.option("--ignore-eos", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def generate(
    prompts: tuple[str, ...],
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
    as_json: bool,
    **engine_kw: Any,
) -> None:
    """Generate text for one or more prompts (MODEL defaults to smollm2-135m)."""
    from qserve.engine.llm_engine import LLMEngine
    from qserve.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        stop=list(stop),
        ignore_eos=ignore_eos,
    )
    engine = LLMEngine(engine_config(**engine_kw))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    stream = len(prompts) == 1 and not as_json
    finished = _run_to_completion(engine, stream)
    if as_json:
        click.echo(json.dumps([_as_dict(finished[str(i)]) for i in range(len(prompts))], indent=2))
    elif not stream:
        for i, prompt in enumerate(prompts):
            click.echo(f"--- {prompt}\n{finished[str(i)].outputs[0].text}")


def _run_to_completion(engine: Any, stream: bool) -> dict[str, Any]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream:
                click.echo(out.outputs[0].delta_text, nl=False)
            if out.finished:
                finished[out.request_id] = out
    if stream:
        click.echo()
    return finished


def _as_dict(out: Any) -> dict[str, Any]:
    o = out.outputs[0]
    return {
        "prompt": out.prompt,
        "text": o.text,
        "token_ids": o.token_ids,
        "finish_reason": o.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
    }


@cli.command()
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--api-key",
    envvar="QSERVE_API_KEY",
    default=None,
    help="Require `Authorization: Bearer KEY` on every API route and /metrics "
    "(env QSERVE_API_KEY).",
)
@click.option(
    "--metrics-public",
    is_flag=True,
    help="Serve /metrics without the API key (it shows prefix-cache hits of every client).",
)
@click.option(
    "--allowed-hosts",
    multiple=True,
    help="Host header names answered (repeatable; * for any). [default: loopback names when "
    "bound to loopback (DNS-rebinding guard), else any]",
)
@click.option(
    "--special-tokens-in-content",
    is_flag=True,
    help="Parse text like <|im_end|> inside chat messages as the special token, as vLLM does "
    "(by default it stays text, so a user cannot forge another role's turn).",
)
@click.option("--served-model-name", default=None, help="Model id clients send; default: MODEL.")
@click.option(
    "--max-queue",
    default=1024,
    show_default=True,
    type=click.IntRange(0),
    help="Sequences (prompts x n) admitted beyond --max-num-seqs; more get 429 with Retry-After.",
)
@limit_options
@click.option(
    "--max-tokens-default",
    default=None,
    type=click.IntRange(1),
    help="max_tokens of a request that gives none. [default: 16 on /v1/completions (vLLM's), "
    "the rest of the context on chat (OpenAI's)]",
)
@click.option(
    "--stream-timeout",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds a streaming client may read nothing before it is cut off and its request "
    "aborted.",
)
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds Ctrl-C / SIGTERM waits for requests in flight.",
)
def serve(
    host: str,
    port: int,
    api_key: str | None,
    metrics_public: bool,
    allowed_hosts: tuple[str, ...],
    special_tokens_in_content: bool,
    served_model_name: str | None,
    max_queue: int,
    max_tokens_default: int | None,
    stream_timeout: float,
    drain_timeout: float,
    **engine_kw: Any,
) -> None:
    """Serve MODEL behind an OpenAI-compatible HTTP API (MODEL defaults to smollm2-135m)."""
    from qserve.engine.llm_engine import LLMEngine
    from qserve.model.builtin import DEFAULT_MODEL
    from qserve.server.limits import RequestLimits

    try:
        from qserve.server.api_server import ServerConfig, run_server
    except ImportError as exc:
        if (exc.name or "").startswith("qserve"):
            raise
        raise QServeError(
            f"qserve serve needs the server packages ({exc.name} is missing): "
            "pip install 'qserve[serve]'"
        ) from None
    config = ServerConfig(
        served_model_name=served_model_name or engine_kw["model"] or DEFAULT_MODEL,
        host=host,
        port=port,
        api_key=api_key or None,
        metrics_public=metrics_public,
        allowed_hosts=allowed_hosts or None,
        special_tokens_in_content=special_tokens_in_content,
        max_queue=max_queue,
        drain_timeout=drain_timeout,
        stream_timeout=stream_timeout,
        limits=RequestLimits(**{f.name: engine_kw.pop(f.name) for f in fields(RequestLimits)}),
        max_tokens_default=max_tokens_default,
    )
    engine = LLMEngine(engine_config(**engine_kw))
    run_server(engine, config)


@cli.command("eval")
@engine_options
@click.option(
    "--data",
    required=True,
    help="A .txt file, a folder of .txt files (name order), or moby-dick-eval (chapters 1-10).",
)
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(2))
@click.option(
    "--max-tokens",
    default=None,
    type=click.IntRange(1),
    help="Score only the first N tokens of the data (same tokens for every model).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_command(
    data: str, seq_len: int, max_tokens: int | None, as_json: bool, **engine_kw: Any
) -> None:
    """Perplexity of MODEL (a folder, quantized checkpoint or alias) on --data, in
    non-overlapping --seq-len windows, through the engine's paged KV cache."""
    from qserve.engine.llm_engine import LLMEngine
    from qserve.eval import evaluate_text, load_eval_text

    text = load_eval_text(data)  # fails fast, before the model loads
    engine = LLMEngine(engine_config(**engine_kw))
    result = evaluate_text(engine, text, seq_len, max_tokens)
    if as_json:
        info = {
            "model": engine_kw["model"],
            "data": data,
            "seq_len": seq_len,
            "max_tokens": max_tokens,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": engine.config.kv_cache_dtype,
        }
        click.echo(json.dumps({**info, **result.to_dict()}))
        return
    click.echo(
        f"perplexity {result.perplexity:.4f}  tokens {result.num_tokens}  "
        f"windows {result.num_windows}  seconds {result.seconds:.2f}"
    )


@cli.command()
@click.argument("model", required=False)
@click.option(
    "-m",
    "--method",
    default=None,
    type=click.Choice(["rtn", "gptq", "awq", "int8", "fp8"]),
    help="rtn/gptq -> GPTQ format, awq -> AWQ gemm, int8/fp8 -> compressed-tensors.",
)
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(file_okay=False),
    help="Checkpoint folder to write. [default: ./MODEL-METHOD-wBITSgGROUP, e.g. "
    "smollm2-135m-gptq-w4g64; int8: MODEL-int8-w8a8, fp8: MODEL-fp8]",
)
@click.option("--bits", default=None, type=int, help="4 or 8 (rtn/gptq); default 4 / 8 by method.")
@click.option(
    "--group-size",
    default="auto",
    show_default=True,
    type=GROUP_SIZE,
    help="32, 64, 128, -1 (per channel) or auto (the largest of 128/64/32 dividing every "
    "quantized linear's input size).",
)
@click.option("--sym/--asym", default=True, show_default=True)
@click.option("--desc-act", is_flag=True, help="GPTQ act-order (columns by descending H diag).")
@click.option("--mse", is_flag=True, help="GPTQ: MSE grid search of each group's range.")
@click.option(
    "--act-group-aware/--no-act-group-aware",
    default=True,
    show_default=True,
    help="GPTQ without --desc-act: visit whole groups by importance (GPTQModel's default).",
)
@click.option(
    "--gptaq/--no-gptaq",
    default=None,
    help="GPTQ: fit each layer to the float model's output (GPTAQ asymmetric calibration); "
    "--no-gptaq is plain GPTQ. [default: --gptaq]",
)
@click.option(
    "--damp",
    default=0.01,
    show_default=True,
    type=float,
    help="GPTQ dampening, a fraction of mean(diag H).",
)
@click.option(
    "--calib-data",
    default=None,
    help="Calibration .txt/.jsonl; default: bundled Moby-Dick chapters 11+.",
)
@click.option("--num-samples", default=128, show_default=True, type=click.IntRange(1))
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(16))
@click.option(
    "--ignore",
    multiple=True,
    default=("lm_head",),
    show_default=True,
    help="Module name (or re:REGEX) left unquantized; repeatable.",
)
@click.option(
    "--quantize-lm-head",
    is_flag=True,
    help="rtn/gptq: quantize lm_head too (same method, bits and groups; untied from embeddings).",
)
@click.option(
    "--smooth-alpha", default=0.5, show_default=True, type=float, help="SmoothQuant alpha (int8)."
)
@click.option(
    "--weight-strategy",
    default="channel",
    show_default=True,
    type=click.Choice(["channel", "tensor"]),
    help="int8/fp8 weight scales.",
)
@click.option(
    "--activation-scheme",
    default="dynamic",
    show_default=True,
    type=click.Choice(["dynamic", "static"]),
    help="int8/fp8 activation scales.",
)
@click.option(
    "--gptq-weights/--no-gptq-weights",
    default=None,
    help="int8/fp8: round the weights with GPTQ error feedback (needs calibration data); "
    "--no-gptq-weights rounds to nearest (fp8 dynamic: no calibration). [default: on]",
)
@click.option(
    "--scales",
    "scales_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="awq/int8: save the searched scales here, or replay them if the file exists.",
)
@click.option(
    "--kv-cache-dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "fp8_e4m3", "fp8_e5m2"]),
    help="FP8: also calibrate and write k_scale/v_scale per attention layer.",
)
@click.option(
    "--device",
    default=None,
    help="Calibrate block by block on cpu, cuda or cuda:N. [default: cuda if available, else cpu]",
)
@click.option(
    "--offload-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Keep decoder blocks on disk (read one at a time from the checkpoint's safetensors), "
    "so models larger than memory quantize; a temporary subfolder is removed at the end.",
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("--recipe", default=None, help="Recipe name or YAML path; explicit flags win.")
def quantize(
    model: str | None,
    method: str | None,
    output: str | None,
    bits: int | None,
    quiet: bool,
    calib_data: str | None,
    **kw: Any,
) -> None:
    """Quantize MODEL (default smollm2-135m) into a checkpoint that transformers, vLLM and
    qserve load."""
    import time

    from transformers.utils import logging as hf_logging

    from qserve.model.builtin import DEFAULT_MODEL
    from qserve.model.resolve import resolve_model
    from qserve.quantize.driver import quantize_model
    from qserve.recipe import provenance

    hf_logging.disable_progress_bar()  # ours shows blocks done and time left
    kw = _with_recipe(dict(kw, method=method, bits=bits, calib_data=calib_data), "quantize")
    recipe = kw.pop("_recipe", None)
    if kw["method"] is None:
        raise QServeError("give --method (rtn, gptq, awq, int8, fp8) or --recipe")
    kw["bits"] = kw["bits"] or (8 if kw["method"] in ("int8", "fp8") else 4)
    kw["calib"] = kw.pop("calib_data")
    start = time.monotonic()
    folder = quantize_model(
        resolve_model(model),
        output,
        progress=None if quiet else _progress_bar,
        model_name=model or DEFAULT_MODEL,
        provenance=provenance(recipe, kw),
        **kw,
    )
    if not quiet:
        click.echo("", err=True)
    click.echo(f"wrote {folder} ({kw['method']}, {time.monotonic() - start:.0f} s)")


def _progress_bar(done: int, total: int, seconds_left: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    click.echo(f"\rblocks [{bar}] {done}/{total}, ~{seconds_left:.0f} s left", nl=False, err=True)


@cli.group()
def recipes() -> None:
    """Hardware recipes: one YAML per target for quantize and serve (--recipe NAME|PATH|auto)."""


@recipes.command("list")
def recipes_list() -> None:
    """One line per shipped recipe: name, target, method, KV cache dtype, description."""
    from qserve.recipe import shipped_recipes

    for recipe in shipped_recipes():
        click.echo(recipe.summary())


@recipes.command("show")
@click.argument("name")
def recipes_show(name: str) -> None:
    """Print the YAML of recipe NAME (a shipped name or a path)."""
    from qserve.recipe import find_recipe

    click.echo(find_recipe(name).path.read_text(), nl=False)


@recipes.command("check")
@click.argument("name", default="auto")
@click.pass_context
def recipes_check(ctx: click.Context, name: str) -> None:
    """Whether this machine meets NAME's `requires:`, and which recipe `--recipe auto` picks.

    Exits 1 when the machine does not meet NAME's requirements (auto: when nothing fits)."""
    from qserve.recipe import AUTO, detect_hardware, find_recipe, unmet_requirements

    hardware = detect_hardware()
    click.echo(f"this machine: {hardware.describe()}")
    picked = _auto_pick(hardware)
    if name == AUTO:
        ctx.exit(0 if picked is not None else 1)
    recipe = find_recipe(name)
    reasons = unmet_requirements(recipe.requires, hardware)
    verdict = "meets" if not reasons else "does not meet: " + "; ".join(reasons)
    click.echo(f"{recipe.name} ({recipe.spec.hardware}): {verdict}")
    if reasons or picked is None:
        ctx.exit(1)


def _auto_pick(hardware: Any) -> Any:
    """Print and return the recipe `--recipe auto` would pick (None when nothing fits)."""
    from qserve.recipe import select_recipe, shipped_recipes

    try:
        recipe = select_recipe(shipped_recipes(), hardware)
    except QServeError as exc:
        click.echo(f"--recipe auto: {exc}")
        return None
    click.echo(f"--recipe auto picks: {recipe.name} ({recipe.spec.description})")
    return recipe


def main() -> None:
    cli(prog_name="qserve")


if __name__ == "__main__":
    main()
