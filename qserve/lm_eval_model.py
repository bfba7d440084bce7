"""lm-evaluation-harness model "qserve": lm-eval's tasks run on the offline engine (`LLM`).

    qserve eval CHECKPOINT --tasks NAME[,NAME] [--include-path DIR] [--limit N]
    qserve-lm-eval run --model qserve --model_args pretrained=CHECKPOINT,dtype=float32 --tasks ...

How lm-eval finds it: `@register_model("qserve")` adds the class to lm-eval's model registry when
this module is imported, as lm-eval's own backends register (its vllm backend is the model for
this one). lm-eval 0.4.13 reads no entry points: its registry only knows the backends its own
`lm_eval/models/__init__.py` lists, plus whatever was imported before `--model` is looked up.
So with 0.4.13, `python -m qserve.lm_eval_model` (or the `qserve-lm-eval` script) runs lm-eval's
own command line after importing this module; every lm_eval argument works the same there.
lm-eval releases that load the `lm_eval.models` entry-point group (added upstream after 0.4.13,
EleutherAI/lm-evaluation-harness#4013) find the entry point qserve declares in pyproject.toml,
and there plain `lm_eval --model qserve` works. In Python, importing this module is enough.

Every request goes through `LLM.generate`, many per call; the engine batches them under its own
limits (max_num_seqs, max_num_batched_tokens), so lm-eval's batch_size is accepted and ignored.
Scoring asks for the prompt's logprobs (`prompt_logprobs=1, max_tokens=1`), as lm-eval's vllm
backend does: a continuation's logprob is the sum over its tokens, and it is greedy when each
token is the top-1 one. Contexts longer than max_model_len - 1 tokens lose their left part;
loglikelihood_rolling scores lm-eval's disjoint rolling windows of max_model_len - 2 tokens.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m qserve.lm_eval_model: run the importable module instead,
    import sys  # so that the model lm-eval registers is qserve.lm_eval_model.QServeLM

    from qserve.lm_eval_model import main

    sys.exit(main())

import logging
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    maybe_truncate,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from qserve.config import EngineConfig
from qserve.engine.sampling_params import SamplingParams
from qserve.errors import QServeError

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from qserve.engine.outputs import RequestOutput

logger = logging.getLogger("qserve")

MODEL_NAME = "qserve"
# Requests handed to one LLM.generate call: enough to keep the engine's batches full, few enough
# that the outputs held at once (prompt logprobs of every token) stay small.
REQUESTS_PER_CALL = 1024
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"model", "device"}
# Model args users of lm-eval's other backends often pass; they mean nothing here.
IGNORED_ARGS = frozenset({"trust_remote_code", "parallelize"})

Request = tuple[Any, list[int], list[int]]  # (cache key or None, context ids, continuation ids)


@register_model(MODEL_NAME)
class QServeLM(TemplateLM):
    """lm-eval's LM interface over qserve's offline engine.

    Model args: `pretrained` (folder, quantized checkpoint, .gguf or built-in alias), `recipe`,
    any EngineConfig field (dtype, kv_cache_memory, max_model_len, max_num_seqs, ...);
    `max_length` is max_model_len's other name, `max_batch_size` max_num_seqs's. lm-eval's own:
    `batch_size` (ignored), `device` (used where it exists, as lm-eval's hf backend does),
    `max_gen_toks`, `prefix_token_id`, `add_bos_token`, `seed` (of sampled generations).
    `engine_config` takes a ready EngineConfig instead (what `qserve eval --tasks` passes).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        recipe: str | None = None,
        engine_config: EngineConfig | None = None,
        batch_size: int | str | None = "auto",
        max_batch_size: int | None = None,
        device: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        prefix_token_id: int | None = None,
        add_bos_token: bool | None = None,
        seed: int = 1234,
        **engine_args: Any,
    ) -> None:
        super().__init__()
        from qserve.engine.llm import LLM

        if engine_config is None:
            engine_config = _engine_config(
                pretrained, recipe, device, max_length, max_batch_size, engine_args
            )
        elif pretrained or recipe or engine_args:
            raise QServeError("give engine_config or pretrained/recipe/engine args, not both")
        config = {f.name: getattr(engine_config, f.name) for f in fields(engine_config)}
        self.llm = LLM(**config)
        self.tokenizer = self.llm.get_tokenizer()
        self.custom_prefix_token_id = prefix_token_id
        self.add_bos_token = add_bos_token
        self._max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        self.batch_size = batch_size  # the engine batches; kept for lm-eval's reports
        self._ignored_kwargs: set[str] = set()

    # -- what lm-eval asks of a model ------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for: the given one, else BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval adds to its results' config."""
        engine = self.llm.engine
        return {
            "model": engine.config.model,
            "weights": engine.load_report.scheme,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": engine.config.kv_cache_dtype,
            "max_model_len": engine.max_model_len,
        }

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids as lm-eval's hf backend makes them (no second BOS on a text that has one)."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        bos_text = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and has_bos_prefix(string, bos_text):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # -- scoring ---------------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(logprob of the continuation, whether it is greedy) per (key, context, continuation)."""
        prompts, ctxlens = [], []
        max_len = self.max_length - 1  # the engine generates at least one token
        truncated = 0
        for _, context, continuation in requests:
            prompt, ctxlen = fit_window(context, continuation, max_len)
            truncated += len(prompt) < len(context) + len(continuation)
            prompts.append(prompt)
            ctxlens.append(ctxlen)
        if truncated:
            logger.warning("%d requests left-truncated to %d tokens", truncated, max_len)
        outputs = self._generate(prompts, SCORE, "loglikelihood requests", disable_tqdm)
        results = [continuation_score(out, n) for out, n in zip(outputs, ctxlens)]
        for (key, _, _), answer in zip(requests, results):
            if key is not None:  # rolling windows have none: cached per document instead
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Logprob of each whole text, over lm-eval's disjoint rolling windows."""
        windows: list[Request] = []
        owners: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in self._rolling_windows(text):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        if self.max_length < 3:
            raise QServeError(f"max_model_len {self.max_length} is too short for rolling windows")
        windows = get_rolling_token_windows(
            token_list=self.tok_encode(text),
            prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length - 2,  # - 1 for the context, - 1 for the generated token
            context_len=1,
        )
        return [make_disjoint_window(w) for w in windows]

    # -- generation ------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Text generated for each (context, gen_kwargs), cut at the first stop sequence."""
        eos = self.tokenizer.decode(self.eot_token_id) or self.tokenizer.eos_token
        prompts, params, stops = [], [], []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            sampling, until, max_gen_toks = self._sampling_params(gen_kwargs, eos, self.seed + i)
            max_gen_toks = min(max_gen_toks, self.max_length - 1)
            prompt, max_gen_toks = maybe_truncate(
                self.tok_encode(context), max_gen_toks=max_gen_toks, max_model_len=self.max_length
            )
            prompts.append(prompt)
            params.append(SamplingParams(**sampling, max_tokens=max_gen_toks))
            stops.append(until)
        outputs = self._generate(prompts, params, "generate_until requests", disable_tqdm)
        texts = []
        for req, out, p, until in zip(requests, outputs, params, stops):
            # The tokens decoded at once, as lm-eval's hf backend does: the engine's streamed
            # text holds back a last character whose bytes the output cut in two.
            text = self.tokenizer.decode(
                out.outputs[0].token_ids, skip_special_tokens=p.skip_special_tokens
            )
            texts.append(postprocess_generated_text(text, until, None))
            self.cache_hook.add_partial("generate_until", req.args, texts[-1])
        return texts

    def _sampling_params(
        self, gen_kwargs: dict[str, Any], eos: str | None, seed: int
    ) -> tuple[dict[str, Any], list[str], int]:
        """(SamplingParams fields, stop sequences, max new tokens) of a task's gen_kwargs."""
        if not isinstance(gen_kwargs, dict):
            raise QServeError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        do_sample = kwargs.pop("do_sample", False)
        unknown = sorted(set(kwargs) - SAMPLING_FIELDS - self._ignored_kwargs)
        if unknown:
            logger.warning("qserve ignores these generation kwargs: %s", ", ".join(unknown))
            self._ignored_kwargs.update(unknown)  # said once
        params = {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS}
        if do_sample and params.get("seed") is None:
            params["seed"] = seed  # reproducible runs, a different stream per request
        return {**params, "stop": until}, until, max_gen_toks

    def _generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        desc: str,
        disable_tqdm: bool,
    ) -> Iterator[RequestOutput]:
        """The engine's outputs in prompt order, REQUESTS_PER_CALL prompts per LLM.generate."""
        with tqdm(total=len(prompts), desc=f"Running {desc}", disable=disable_tqdm) as bar:
            for start in range(0, len(prompts), REQUESTS_PER_CALL):
                stop = start + REQUESTS_PER_CALL
                part = params if isinstance(params, SamplingParams) else params[start:stop]
                outputs = self.llm.generate(list(prompts[start:stop]), part)
                bar.update(len(outputs))
                yield from outputs


# -- helpers ---------------------------------------------------------------------------------


def fit_window(context: list[int], continuation: list[int], max_len: int) -> tuple[list[int], int]:
    """(prompt, number of context tokens in it): context + continuation, the context cut from
    the left to fit `max_len` tokens (lm-eval's vllm backend's rule). At least one context
    token must remain, since the first prompt token has no logprob."""
    if len(continuation) >= max_len:
        raise QServeError(
            f"a continuation of {len(continuation)} tokens leaves no room for context in "
            f"max_model_len {max_len + 1}"
        )
    prompt = (context + continuation)[-max_len:]
    return prompt, len(prompt) - len(continuation)


def continuation_score(output: RequestOutput, ctxlen: int) -> tuple[float, bool]:
    """(sum of the prompt logprobs from position ctxlen on, whether each token is the top-1)."""
    rows = output.prompt_logprobs[ctxlen:]
    logprob = sum(row.logprob for row in rows)
    greedy = all(row.top_token_ids[0] == row.sampled_token_id for row in rows)
    return logprob, greedy


def _engine_config(
    pretrained: str | None,
    recipe: str | None,
    device: str | None,
    max_length: int | None,
    max_batch_size: int | None,
    engine_args: dict[str, Any],
) -> EngineConfig:
    """EngineConfig from lm-eval model args, over the recipe (if any), over the defaults."""
    from qserve.commands.common import engine_config

    unknown = sorted(set(engine_args) - ENGINE_FIELDS - IGNORED_ARGS)
    if unknown:
        raise QServeError(
            f"unknown qserve model args: {', '.join(unknown)} "
            f"(engine args: {', '.join(sorted(ENGINE_FIELDS))})"
        )
    kw = {k: v for k, v in engine_args.items() if k in ENGINE_FIELDS}
    if max_length is not None:
        kw.setdefault("max_model_len", int(max_length))
    if max_batch_size is not None:
        kw.setdefault("max_num_seqs", int(max_batch_size))
    return engine_config(model=pretrained, recipe=recipe, device=_device(device), **kw)


def _device(device: str | None) -> str | None:
    """lm-eval's --device (cuda:0 unless given) where it exists, else the engine's default."""
    if device is None or device == "cpu":
        return device
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index
        if index is None or index < torch.cuda.device_count():
            return device
    logger.info("device %s is not available here: using the engine's default", device)
    return None


def main() -> None:
    """lm-eval's command line, with the "qserve" model registered (lm-eval 0.4.13 reads no
    entry points): `python -m qserve.lm_eval_model run --model qserve --model_args ...`."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
