"""`client.chat.completions.parse(response_format=Model)` against a real server on SmolLM2-135M:
five schemas (nested objects, arrays, enums, bounded numbers, optional fields) at temperature
1.0 with 10 seeds each, sent concurrently; all 50 must parse and validate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME, running_server

pytestmark = pytest.mark.slow


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=30)
    address: Address


class ShoppingList(BaseModel):  # arrays
    items: list[Annotated[str, Field(max_length=30)]] = Field(min_length=1, max_length=5)


class Weather(BaseModel):  # enums
    sky: Literal["sunny", "cloudy", "rainy", "snowy"]
    wind: Literal["calm", "breezy", "stormy"]


class Rating(BaseModel):  # bounded numbers
    stars: int = Field(ge=1, le=5)
    score: float = Field(ge=0.0, le=10.0)


class Book(BaseModel):  # optional fields
    title: str = Field(max_length=40)
    year: int | None = Field(default=None, ge=1000, le=2100)
    subtitle: str | None = Field(default=None, max_length=40)


CASES = [
    (Person, "Invent a person and where they live."),
    (ShoppingList, "Write a short shopping list."),
    (Weather, "Describe today's weather."),
    (Rating, "Rate the novel Moby-Dick."),
    (Book, "Name a famous book."),
]
SEEDS = range(10)


def test_fifty_of_fifty_parse() -> None:
    from qserve.config import EngineConfig
    from qserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig("smollm2-135m", kv_cache_memory="256MiB", max_num_seqs=16))
    with running_server(engine) as server, server.client(timeout=300) as client:

        def ask(case: tuple[type[BaseModel], str], seed: int) -> BaseModel | None:
            model, question = case
            completion = client.chat.completions.parse(
                model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                response_format=model, temperature=1.0, seed=seed, max_tokens=400,
            )  # fmt: skip
            return completion.choices[0].message.parsed

        with ThreadPoolExecutor(16) as pool:
            futures = [(case, pool.submit(ask, case, seed)) for case in CASES for seed in SEEDS]
            parsed = [(case[0], future.result()) for case, future in futures]
    assert len(parsed) == 50
    for model, value in parsed:
        assert isinstance(value, model)
