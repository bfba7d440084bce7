"""qserve: quantize Hugging Face LLMs and serve them on a paged-KV engine."""

from typing import Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import qserve` stays cheap (no torch until the engine is used).
    if name == "LLM":
        from qserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from qserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
