"""The commands that run the engine: generate, serve, eval."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from qserve.commands.common import engine_config, engine_options, limit_options
from qserve.errors import QServeError, read_user_text


@click.command()
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
    try:  # parallel workers stop here, not in an exit handler
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        stream = len(prompts) == 1 and not as_json
        finished = _run_to_completion(engine, stream)
    finally:
        engine.close()
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


@click.command()
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
    "--allowed-origins",
    multiple=True,
    help="Origins whose web pages may call the API (CORS), e.g. http://localhost:3000; "
    "repeatable, or a JSON list as vLLM takes it; * for any. [default: none]",
)
@click.option(
    "--ui/--no-ui",
    default=True,
    show_default=True,
    help="Serve the chat playground page at /.",
)
@click.option(
    "--special-tokens-in-content",
    is_flag=True,
    help="Parse text like <|im_end|> inside chat messages as the special token, as vLLM does "
    "(by default it stays text, so a user cannot forge another role's turn).",
)
@click.option(
    "--chat-template",
    default=None,
    help="A Jinja chat template file used instead of the model's.",
)
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='Let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser.',
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(["hermes", "llama3_json", "mistral"]),
    default=None,
    help="How tool calls are read out of the model's text (Qwen/Hermes, Llama 3, Mistral).",
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
    allowed_origins: tuple[str, ...],
    ui: bool,
    special_tokens_in_content: bool,
    chat_template: str | None,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
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
    if enable_auto_tool_choice != (tool_call_parser is not None):
        raise QServeError("--enable-auto-tool-choice and --tool-call-parser go together")
    config = ServerConfig(
        chat_template=read_user_text(chat_template, "chat template") if chat_template else None,
        tool_call_parser=tool_call_parser,
        served_model_name=served_model_name or engine_kw["model"] or DEFAULT_MODEL,
        host=host,
        port=port,
        api_key=api_key or None,
        metrics_public=metrics_public,
        allowed_hosts=allowed_hosts or None,
        allowed_origins=allowed_origins,
        ui=ui,
        special_tokens_in_content=special_tokens_in_content,
        max_queue=max_queue,
        drain_timeout=drain_timeout,
        stream_timeout=stream_timeout,
        limits=RequestLimits(**{f.name: engine_kw.pop(f.name) for f in fields(RequestLimits)}),
        max_tokens_default=max_tokens_default,
    )
    engine = LLMEngine(engine_config(**engine_kw))
    run_server(engine, config)


@click.command("eval")
@engine_options
@click.option(
    "--data",
    default=None,
    help="Perplexity data: a .txt file, a folder of .txt files (name order), or moby-dick-eval "
    "(chapters 1-10).",
)
@click.option(
    "--tasks",
    default=None,
    help="lm-eval tasks or groups, comma-separated, run on MODEL instead of --data "
    "(pip install 'qserve[eval]').",
)
@click.option("--include-path", default=None, help="A folder of more lm-eval task YAMLs.")
@click.option(
    "--limit", default=None, type=click.IntRange(1), help="Only the first N documents per task."
)
@click.option("--num-fewshot", default=None, type=click.IntRange(0), help="Few-shot examples.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(2))
@click.option(
    "--max-tokens",
    default=None,
    type=click.IntRange(1),
    help="Score only the first N tokens of the data (same tokens for every model).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_command(
    data: str | None,
    tasks: str | None,
    include_path: str | None,
    limit: int | None,
    num_fewshot: int | None,
    seq_len: int,
    max_tokens: int | None,
    as_json: bool,
    **engine_kw: Any,
) -> None:
    """Perplexity of MODEL (a folder, quantized checkpoint or alias) on --data, in
    non-overlapping --seq-len windows, through the engine's paged KV cache; or lm-eval's
    --tasks on MODEL, through the same engine (model "qserve", qserve.lm_eval_model)."""
    if (data is None) == (tasks is None):
        given = "both" if data is not None else "neither"
        raise QServeError(f"give one of --data (perplexity) and --tasks (lm-eval), not {given}")
    if tasks is not None:
        _only_with("--tasks", "seq_len", "max_tokens")
        _run_lm_eval_tasks(tasks, include_path, limit, num_fewshot, as_json, engine_kw)
        return
    _only_with("--data", "include_path", "limit", "num_fewshot")
    _perplexity(data, seq_len, max_tokens, as_json, engine_kw)


def _only_with(mode: str, *others: str) -> None:
    """QServeError when the command line gave one of `others`, options that `mode` ignores."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    for name in others:
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-")
            raise QServeError(f"{flag} does not apply with {mode}", param=name)


def _perplexity(
    data: str, seq_len: int, max_tokens: int | None, as_json: bool, engine_kw: dict[str, Any]
) -> None:
    from qserve.engine.llm_engine import LLMEngine
    from qserve.eval import evaluate_text, load_eval_text

    text = load_eval_text(data)  # fails fast, before the model loads
    engine = LLMEngine(engine_config(**engine_kw))
    try:
        result = evaluate_text(engine, text, seq_len, max_tokens)
    finally:
        engine.close()
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


def _run_lm_eval_tasks(
    tasks: str,
    include_path: str | None,
    limit: int | None,
    num_fewshot: int | None,
    as_json: bool,
    engine_kw: dict[str, Any],
) -> None:
    """lm-eval's simple_evaluate on the tasks with model "qserve"; prints lm-eval's tables."""
    try:
        from lm_eval import evaluator, utils
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise QServeError(
            f"--tasks runs lm-eval, which is not installed ({exc.name} is missing): "
            "pip install 'qserve[eval]'",
            param="tasks",
        ) from None
    names = [name.strip() for name in tasks.split(",") if name.strip()]
    if not names:
        raise QServeError("--tasks names no task", param="tasks")
    if include_path is not None and not Path(include_path).is_dir():
        raise QServeError(f"--include-path {include_path} is not a folder", param="include_path")
    manager = TaskManager(include_path=include_path)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise QServeError(
            f"unknown lm-eval task: {', '.join(unknown)} (`lm_eval ls tasks` lists them; "
            "--include-path adds a folder of task YAMLs)",
            param="tasks",
        )
    from qserve.lm_eval_model import QServeLM

    model = QServeLM(engine_config=engine_config(**engine_kw))  # fails before tasks load
    results = evaluator.simple_evaluate(
        model=model, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot
    )
    if as_json:
        keys = ("results", "groups", "n-samples", "versions")
        shown = {key: results[key] for key in keys if key in results}
        click.echo(json.dumps(shown, default=utils.handle_non_serializable))
        return
    click.echo(utils.make_table(results))
    if results.get("groups"):
        click.echo(utils.make_table(results, "groups"))
