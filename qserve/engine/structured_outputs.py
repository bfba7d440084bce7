"""Grammar-constrained decoding with xgrammar (vLLM's `structured_outputs`).

A request's `SamplingParams.structured_outputs` names one constraint: a JSON schema (`json`),
any JSON object (`json_object`), a regex, a choice of strings, or an EBNF grammar. The engine
compiles it once per distinct constraint (`StructuredOutputManager`: xgrammar's compiler, whose
cache keeps compiled grammars) into a `CompiledGrammar`, and gives the request its own
`GrammarMatcher`. Each step, the rows of constrained requests get a token bitmask filled from
their matcher and applied to the logits before sampling (allowed tokens keep their logits,
others become -inf); requests with different grammars share the batch. The sampled token is
then fed to the matcher (`Request.append_output_token_ids`); a matcher that reaches its end
(it accepted a stop token) finishes the request with "stop".

xgrammar is imported lazily: without it a constrained request is a one-line error. A schema,
regex or grammar xgrammar refuses is a QServeError naming the parameter.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from qserve.errors import QServeError

if TYPE_CHECKING:
    from qserve.engine.request import Request

INSTALL_HINT = "structured outputs need xgrammar: pip install 'qserve[serve]'"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names). `json` is a schema (a dict or its JSON text);
    `param` is the request field the errors name."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise QServeError(
                "structured outputs take exactly one of json, regex, choice, grammar or "
                f"json_object; got {what}",
                param=self.param,
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise QServeError("choice must be a list of non-empty strings", param=self.param)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal constraints share one compiled grammar."""
        if self.json is not None:
            schema = self.json
            return "json", schema if isinstance(schema, str) else json.dumps(schema)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and hands out matchers. Thread-safe: the server
    compiles off the engine thread."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The CompiledGrammar of `params` (cached); a refused constraint is a QServeError."""
        key = params.key
        with self._lock:
            cached = self._compiled.get(key)
        if cached is not None:
            return cached
        try:
            compiled = self._compile(key)
        except (RuntimeError, ValueError, TypeError) as exc:
            text = str(exc).strip()
            reason = _xgrammar_reason(text) if text else type(exc).__name__
            raise QServeError(f"invalid {key[0]}: {reason}", param=params.param) from None
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    def _compile(self, key: tuple[str, str]) -> Any:
        kind, text = key
        if kind == "json":
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            return self._compiler.compile_regex("|".join(_regex_escape(c) for c in choices))
        if kind == "grammar":
            return self._compiler.compile_grammar(text)
        # OpenAI's json_object mode: a JSON object (xgrammar's built-in grammar takes any value)
        return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh GrammarMatcher for one request."""
        return _xgrammar().GrammarMatcher(self.compile(params))


def apply_grammar_bitmask(logits: torch.Tensor, requests: list[Request]) -> None:
    """Mask, in place, the logits rows of requests with a grammar to the tokens it allows."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    xgr = _xgrammar()
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    for i in rows:
        requests[i].grammar.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    # xgrammar picks its kernel by device: its CPU one here, its CUDA/Triton one on a GPU
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)


def _xgrammar_reason(text: str) -> str:
    """xgrammar's message without its `[time] file.cc:line:` prefix, on one line."""
    line = text.splitlines()[0]
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line


def _regex_escape(text: str) -> str:
    """`text` as a regex matching it literally (xgrammar's regex dialect: ECMAScript-like)."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/-" else c for c in text)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise QServeError(INSTALL_HINT) from None
    return xgrammar
