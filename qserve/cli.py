"""The `qserve` command line."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from qserve.errors import QServeError


class _Group(click.Group):
    """Turns QServeError into one line on stderr and exit status 2, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except QServeError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(2)


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


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every command that runs the engine (generate, serve, eval)."""
    options = [
        click.argument("model", required=False),
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


def engine_config(**kw: Any) -> Any:
    from qserve.config import EngineConfig

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
    help="Require `Authorization: Bearer KEY` on every API route (env QSERVE_API_KEY).",
)
@click.option("--served-model-name", default=None, help="Model id clients send; default: MODEL.")
@click.option(
    "--max-queue",
    default=1024,
    show_default=True,
    type=click.IntRange(0),
    help="Requests admitted beyond --max-num-seqs; more get 429 with Retry-After.",
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
    served_model_name: str | None,
    max_queue: int,
    drain_timeout: float,
    **engine_kw: Any,
) -> None:
    """Serve MODEL behind an OpenAI-compatible HTTP API (MODEL defaults to smollm2-135m)."""
    from qserve.engine.llm_engine import LLMEngine
    from qserve.model.builtin import DEFAULT_MODEL

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
        max_queue=max_queue,
        drain_timeout=drain_timeout,
    )
    engine = LLMEngine(engine_config(**engine_kw))
    run_server(engine, config)


def main() -> None:
    cli(prog_name="qserve")


if __name__ == "__main__":
    main()
